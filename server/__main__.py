"""`python -m server` / `moa-server`: serve a target (and a drafter's memory head) to edge clients."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from typing import TYPE_CHECKING

from server.config import ServerConfig, parse_args

if TYPE_CHECKING:  # torch and the models load after the command line is parsed, so --help is instant
    from server.app import App
    from server.session import Model

log = logging.getLogger("moa.server")


def load_model(config: ServerConfig) -> Model:
    """The target and the drafter's memory head, as configured."""
    import torch

    from models.registry import load_drafter, load_target
    from server.session import Model

    if config.threads:
        torch.set_num_threads(config.threads)
    target = load_target(config.target, dtype=config.resolved_dtype, device=config.resolved_device,
                         quantize=config.quantize)
    drafter = None if config.drafter == "none" else load_drafter(config.drafter, target)
    log.info("target %s (%s, %s), drafter %s", target.label, config.resolved_device, config.resolved_dtype,
             config.drafter)
    model = Model(target, drafter, config.limits, config.tree, config.batching)
    if model.costs:
        c = model.costs
        log.info("verify round by tree size at context %d (sent to edges for tree auto): %s; decode step %.1f ms",
                 c.contexts[0], ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in c.verify_s[0].items()
                                          if n in (1, 5, 9, 17, 33, 65)), c.decode_s[0] * 1e3)
    return model


async def serve_until_signal(app: App, config: ServerConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with app.serve(config.host, config.port, config.ssl_context()):
        await stop.wait()
    log.info("shut down")


def check_address(host: str, port: int) -> None:
    """Exit with a message if host:port cannot be listened on (checked before the model loads)."""
    try:
        socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError as e:
        sys.exit(f"moa-server: cannot listen on {host}:{port}: {e.strerror or e}")


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    check_address(config.host, config.port)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from models.drafter import FingerprintMismatch, OneDeviceOnly
    from models.target import TargetLoadError
    from server.app import App
    from server.auth import Credentials

    try:
        model = load_model(config)
    except (TargetLoadError, FingerprintMismatch, OneDeviceOnly, FileNotFoundError) as e:
        hint = " (--drafter none serves generate only)" if isinstance(e, FileNotFoundError) else ""
        sys.exit(f"moa-server: {e}{hint}")
    try:
        asyncio.run(serve_until_signal(App(model, Credentials(config.tokens)), config))
    except OSError as e:  # the address was taken while the model loaded
        sys.exit(f"moa-server: cannot listen on {config.host}:{config.port}: {e.strerror or e}")


if __name__ == "__main__":
    main()
