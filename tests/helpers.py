"""Shared test helpers: quickly trained tiny drafters, so that speculative paths really get accepted; a server that
resets every connection."""

from __future__ import annotations

import socket
import struct
import threading

import torch

from models.data import Encoded
from models.drafter import build_drafter, trainable_parameters
from models.train import TrainConfig, collate, train_step_loss


def greedy_continuations(target, n: int, prompt_len: int = 6, new: int = 40, seed: int = 0) -> list[Encoded]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, target.spec.vocab_size, (prompt_len,), generator=g).tolist()
        runner = target.new_runner()
        step = runner.forward(ids)
        for _ in range(new):
            ids.append(int(step.logits[-1].argmax()))
            step = runner.forward(ids[-1:])
        out.append(Encoded(str(i), ids, [0] * prompt_len + [1] * new))
    return out


def train_tiny(target, arch: str, steps: int = 150, seed: int = 0):
    """A drafter distilled from the tiny target's own greedy text: high acceptance in seconds."""
    torch.manual_seed(seed)
    data = greedy_continuations(target, 32, seed=seed)
    drafter = build_drafter(arch, target).train()
    params = trainable_parameters(drafter)
    opt = torch.optim.AdamW(params, lr=3e-3)
    cfg = TrainConfig(sync_min=2, sync_max=6)
    for step in range(steps):
        batch = [data[(step * 8 + j) % len(data)] for j in range(8)]
        (loss, _), _ = train_step_loss(drafter, target, *collate(batch), cfg, step, 0.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval().requires_grad_(False)


class ResetServer:
    """A loopback TCP server that accepts every connection and resets it at once (RST, no websocket handshake):
    `with ResetServer(port) as s:` ... `s.resets` connections reset so far."""

    def __init__(self, port: int = 0):
        self.sock = socket.create_server(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.resets = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="reset-server")

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            self.resets += 1

    def __enter__(self) -> "ResetServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(10)
