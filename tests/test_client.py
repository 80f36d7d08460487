"""The edge client against real verify-server processes on loopback, with a tiny target and a tiny exported bundle:
greedy speculative output equals the server's own generation (api mode), a lost reply is retried with its seq, a
killed server is survived offline and resumed after a restart, `verify` rewinds to the target's text, offline mode
needs no server, and a wrong token or a bundle for another model fail clearly before any generation."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from typing import Iterator

import pytest

from moa_core import protocol as P
from edge_client.client import AsyncEdgeSession, EdgeSession, LinkDown, ServerError, common_prefix
from moa_core.drafting import OfflineGuard
from export.to_onnx import export_bundle
from server.process import free_port
from tests.helpers import FAST_BACKOFF, NEW, PROMPT, TOKEN, TREE, apply, edge_cli, pull_until, train_tiny, \
    varied_target, verify_server

@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[dict]:
    """The target, drafter and bundle on disk, and three servers: one shared, two to crash."""
    root = tmp_path_factory.mktemp("client")
    target = varied_target(root / "target")
    record = {"heldout": {"depth_agreement_topk": {w: [0.9] * 6 for w in ("1", "2", "4", "8")}}}  # for tree auto
    train_tiny(target, "moa", steps=100).save_pretrained(root / "drafter", extra={"training": record})
    servers = {name: verify_server(root / "target", root / "drafter").start() for name in ("main", "crash1", "crash2")}
    export_bundle(root / "drafter", root / "bundle", "fp32", target, parity_prompts=(PROMPT,), heldout_prompts=(),
                  log=lambda s: None)
    try:
        for server in servers.values():
            server.wait_ready()
        yield {"target": target, "bundle": root / "bundle", "root": root, **servers}
    finally:
        for server in servers.values():
            if server.proc.poll() is None:
                server.kill()


def session(env: dict, server: str = "main", **kw) -> EdgeSession:
    return EdgeSession(env["bundle"], env[server].url, TOKEN, threads=1, **{"tree": TREE, **kw})


@pytest.fixture(scope="module")
def api(env) -> EdgeSession:
    with session(env, mode="api") as s:
        yield s


@pytest.fixture(scope="module")
def reference(api) -> list[int]:
    """The server's own greedy generation for PROMPT."""
    out = api.complete(PROMPT, max_new_tokens=NEW).token_ids
    assert len(out) == NEW and len(set(out)) > 4  # a real text, not one token repeated
    return out


# ---- online ---------------------------------------------------------------------------------------------------
def test_cli_speculative_equals_api(env, reference):
    runs = {}
    for mode in ("api", "speculative"):
        out = edge_cli(PROMPT, "--bundle", str(env["bundle"]), "--server", env["main"].url, "--token", TOKEN,
                       "--mode", mode, "--tree", TREE, "--max-new-tokens", str(NEW), "--json")
        assert out.returncode == 0, out.stderr
        runs[mode] = json.loads(out.stdout)
    api, spec = runs["api"], runs["speculative"]
    assert spec["token_ids"] == api["token_ids"] == reference and spec["text"] == api["text"]
    stats = spec["stats"]
    for key in ("new_tokens", "tau", "server_calls", "offline_tokens", "tokens_per_s", "bytes_up", "bytes_down",
                "network_wait_s", "mode"):
        assert key in stats
    assert stats["mode"] == "speculative" and stats["new_tokens"] == NEW and stats["offline_tokens"] == 0
    assert stats["tau"] > 1.2 and stats["server_calls"] < NEW  # drafts really get accepted
    assert api["stats"]["mode"] == "api" and api["stats"]["server_calls"] == 1


@pytest.mark.parametrize("row_dtype", ["fp16", "int8"])
def test_session_streams_the_api_text(env, api, reference, row_dtype):
    with session(env, row_dtype=row_dtype) as s:
        for prompt in (PROMPT, [{"role": "user", "content": "What is 2 plus 2?"}]):
            chunks = list(s.generate(prompt, max_new_tokens=NEW))
            want = reference if prompt == PROMPT else api.complete(prompt, max_new_tokens=NEW).token_ids
            assert s.result.token_ids == want and apply(chunks) == s.result.text
            assert not any(c.rewind or c.offline for c in chunks) and s.stats.verify_calls < NEW


def test_tree_auto_weighs_server_and_edge_costs(env, reference):
    with session(env, tree="auto") as s:
        assert "server verify round of 1 token" in s.tree_note and "round trip" in s.tree_note, s.tree_note
        assert s.tree.total_tokens < s._link.welcome["limits"]["max_tree_tokens"]
        for _ in range(100):  # the server alone made to look far slower: on a loaded machine the Pacer could hand
            s.pacer.observe(False, 1, 100.0)  # the replies over (tested below), and no round would run the tree
        predicted = s.predict_s(len(s.encode(PROMPT)), NEW)
        assert s.complete(PROMPT, max_new_tokens=NEW).token_ids == reference
        assert predicted > 0 and s.stats.predicted_s == pytest.approx(predicted, rel=0.3)  # made before it
        # the tuner saw every round of the drafter's tree alone, and the next reply runs the tree it holds then
        assert sum(s.tuner.observed().values()) == s.stats.verify_calls - s.stats.copy_rounds > 0
        assert s.complete(PROMPT, max_new_tokens=NEW).token_ids == reference
        assert s.stats.tree == str(s.tree) == str(s.tuner.choice.tree) and s.core.tree == s.tree


def test_edge_lets_the_server_generate_while_speculation_does_not_pay(env, reference, caplog):
    with session(env, tree="auto") as s, caplog.at_level(logging.INFO, logger="moa.edge"):
        for _ in range(10):  # rounds that made one token a second: far slower than the server alone
            s.pacer.observe(True, 1, 1.0)
        for _ in range(2):
            assert s.complete(PROMPT, max_new_tokens=NEW).token_ids == reference
            assert s.stats.mode == "api" and s.stats.server_calls == 1
        assert sum("does not pay" in r.getMessage() for r in caplog.records) <= 1  # said once (if not at connect)
        for _ in range(100):  # and now rounds that pay (the 1-second rounds fade at 0.9 a round)
            s.pacer.observe(True, 8, 1e-5)
        assert s.complete(PROMPT, max_new_tokens=NEW).token_ids == reference
        assert s.stats.mode == "speculative" and s.stats.verify_calls > 0
        assert any("pays again" in r.getMessage() for r in caplog.records)


def test_a_reply_handed_over_mid_way_is_the_api_text(env, reference, caplog):
    caplog.set_level(logging.INFO, "moa.edge")
    with session(env) as s:
        chunks = list(s.generate(PROMPT, max_new_tokens=NEW, handover_after=4))
        assert s.result.token_ids == reference and apply(chunks) == s.result.text
        assert 0 < s.stats.handover_tokens < NEW and s.stats.verify_calls > 0 and s.result.unverified == 0
        assert "rest of this reply alone" in caplog.text
    for handover in (True, False):  # the Pacer's verdict turns against speculation in the middle of the reply
        with session(env, tree="auto", handover=handover) as s:
            chunks = s.generate(PROMPT, max_new_tokens=NEW)
            shown = pull_until(chunks, lambda: s.stats.verify_calls >= 1)
            for _ in range(10):  # rounds that made one token a second: far slower than the server alone
                s.pacer.observe(True, 1, 1.0)
            shown += list(chunks)
            assert s.result.token_ids == reference and apply(shown) == s.result.text
            assert (s.stats.handover_tokens > 0) == handover and s.stats.mode == "speculative"


def test_link_lost_during_a_handover_goes_offline_and_resumes(env, reference, caplog):
    caplog.set_level(logging.INFO, "moa.edge")
    with session(env, backoff_s=FAST_BACKOFF) as s:
        chunks = s.generate(PROMPT, max_new_tokens=NEW, handover_after=4)
        shown = pull_until(chunks, lambda: s.stats.handover_tokens > 0)
        handed = len(s.tokens) - len(s.prompt)  # verified tokens, the root and the server's own after it
        s._link.close()  # the link drops while the server streams
        shown += pull_until(chunks, lambda: s.stats.offline_tokens > 0)
        assert s.wait_for_link(10)  # the tiny drafter could end the reply offline before the reconnect is back
        shown += list(chunks)
        out = s.result.token_ids
        assert out[:handed] == reference[:handed] and apply(shown) == s.result.text  # nothing lost or repeated
        assert "offline" in caplog.text and s.stats.reconnects == 1
        assert s.result.unverified == s.stats.offline_tokens  # the server's own tokens count as verified


def test_async_session(env, reference):
    async def run() -> tuple[str, list[int]]:
        s = await AsyncEdgeSession.open(env["bundle"], env["main"].url, TOKEN, tree=TREE, threads=1)
        text = "".join([chunk async for chunk in s.generate(PROMPT, max_new_tokens=NEW)])
        await s.close()
        return text, s.result.token_ids

    text, ids = asyncio.run(run())
    assert ids == reference and text


def test_lost_reply_is_retried_with_the_same_seq(env, reference):
    with session(env) as s:
        chunks = s.generate(PROMPT, max_new_tokens=NEW)
        shown = pull_until(chunks, lambda: s.stats.verify_calls >= 2)
        link, sid, recv = s._link, s.session_id, s._link.recv

        def lose_reply() -> bytes:  # the server answered, the answer never arrived
            recv()
            raise LinkDown("reply lost")

        link.recv = lose_reply
        shown += list(chunks)
        assert s.stats.retries == 1 and s.stats.offline_tokens == 0 and s.session_id == sid and s._link is not link
        assert s.result.token_ids == reference and apply(shown) == s.result.text


def test_edge_benchmark(env, tmp_path):
    from bench.__main__ import main as bench

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "chat", "turns": [PROMPT, "and then?"]}) + "\n" +
                       json.dumps({"question_id": 2, "category": "qa", "turns": ["What is 2 plus 2?"]}) + "\n")
    out = tmp_path / "bench"
    bench(["edge", "--prompts", str(prompts), "--methods", "api,moa,api+copy", "--max-new-tokens", "24", "--out", str(out),
           "--moa-bundle", str(env["bundle"]), "--moa-server", env["main"].url, "--token", TOKEN, "--tree", TREE,
           "--threads", "1", "--no-progress"])
    results = json.loads((out / "results.json").read_text())
    api, moa = results["methods"]["api"], results["methods"]["moa"]
    assert list(results["methods"]) == ["api", "moa", "api+copy"] and results["settings"]["benchmark"] == "edge"
    assert api["outputs_match_api"] == moa["outputs_match_api"] == 1.0 and api["speedup"] == 1.0
    copied = results["methods"]["api+copy"]  # the server alone, verifying copy chains: the same text
    assert copied["outputs_match_api"] == 1.0 and copied["tau"] >= 1.0 and copied["api_share"] == 1.0
    assert api["copy_round_share"] == moa["copy_round_share"] == 0
    assert api["tau"] == 1.0 and moa["tau"] > 1.2  # drafts are accepted
    assert api["server_calls_per_token"] < moa["server_calls_per_token"] < 1  # one generate per turn
    assert moa["bytes_per_token"] > api["bytes_per_token"]  # trees up, memory rows down
    assert set(moa["per_category"]) == {"chat", "qa"} and moa["new_tokens"] == api["new_tokens"] > 24
    assert "| moa | all |" in (out / "results.md").read_text() and (out / "results.png").stat().st_size > 0
    assert len((out / "outputs.jsonl").read_text().splitlines()) == 6


def test_serve_benchmark_through_an_emulated_link(env, tmp_path):
    """`bench serve`: api and MoA clients, 1 and 2 at once over the same two prompts, against batching and FIFO
    servers it starts, behind a 20 ms link; greedy outputs equal api's everywhere."""
    from bench.__main__ import main as bench

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "chat", "turns": [text]}) + "\n"
                               for i, text in enumerate([PROMPT, "What is 2 plus 2?"])))
    out = tmp_path / "serve"
    bench(["serve", "--prompts", str(prompts), "--clients", "1,2", "--link", "rtt=20,bw=50,jitter=4", "--methods",
           "api,moa", "--max-new-tokens", "12", "--target", str(env["root"] / "target"), "--moa-drafter",
           str(env["root"] / "drafter"), "--moa-bundle", str(env["bundle"]), "--token", TOKEN, "--tree", TREE,
           "--threads", "1", "--out", str(out), "--no-progress"])
    results = json.loads((out / "results.json").read_text())
    runs = {(r["batching"], r["clients"], r["method"]): r for r in results["runs"]}
    assert set(runs) == {(b, n, m) for b in ("on", "off") for n in (1, 2) for m in ("api", "moa")}
    for (batching, n, method), r in runs.items():
        assert r["outputs_match_api"] == 1.0 and r["new_tokens"] == 12 * 2 and r["link"] == "rtt=20,bw=50,jitter=4"
        assert r["ttft_s_median"] >= 0.018  # at least one emulated round trip (rtt 20 ms, jitter +-2 ms)
        assert r["total_tokens_per_s"] > 0 and r["bytes_per_token"] > 0
        assert (r["mean_batch_size"] is None) == (batching == "off")
        if method == "moa":
            assert r["tau"] > 1 and r["server_forwards_per_token"] < 1
    for n in (1, 2):  # batching never runs more forwards than FIFO
        assert runs["on", n, "api"]["server_forwards_per_token"] <= runs["off", n, "api"]["server_forwards_per_token"]
    table = (out / "results.md").read_text()
    assert "| rtt=20,bw=50,jitter=4 | 2 | moa | on |" in table and (out / "results.png").stat().st_size > 0
    assert "| moa batching / FIFO | moa / api, batching |" in table  # the summary on top
    ratio = runs["on", 2, "moa"]["total_tokens_per_s"] / runs["off", 2, "moa"]["total_tokens_per_s"]
    assert f"| {ratio:.2f}x |" in table.split("Every figure")[0]
    assert len((out / "outputs.jsonl").read_text().splitlines()) == 2 * 2 * 2 * 2  # modes x counts x methods x prompts


# ---- offline and resync ---------------------------------------------------------------------------------------
def test_killed_server_finishes_offline(env, reference, caplog):
    caplog.set_level(logging.INFO, "moa.edge")
    with session(env, "crash1", backoff_s=FAST_BACKOFF) as s:
        chunks = s.generate(PROMPT, max_new_tokens=NEW)
        shown = pull_until(chunks, lambda: s.length - len(s.prompt) >= 8)
        verified = s.length - len(s.prompt)
        env["crash1"].kill()
        shown += list(chunks)
        out = s.result.token_ids
        assert out[:verified] == reference[:verified]  # nothing lost, nothing repeated
        assert len(out) == NEW or s.result.finish_reason == "eos"
        assert s.stats.offline_tokens > 0 and not s.online and "offline" in caplog.text
        assert apply(shown) == s.result.text == s.tokenizer.decode(out)
        assert any(c.offline for c in shown) and not any(c.rewind for c in shown)

        # the next turn starts while the server is still down: offline, memory from the earlier turn
        turn = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": s.result.text},
                {"role": "user", "content": "more"}]
        chunks = list(s.generate(turn, max_new_tokens=12))
        assert 0 < len(s.result.token_ids) == s.stats.offline_tokens <= 12 and apply(chunks) == s.result.text


def test_restart_resumes_and_verify_rewinds_to_the_api_text(env, reference, caplog):
    caplog.set_level(logging.INFO, "moa.edge")
    server = env["crash2"]
    with session(env, "crash2", on_reconnect="verify", backoff_s=FAST_BACKOFF) as s:
        chunks = s.generate(PROMPT, max_new_tokens=NEW)
        shown = pull_until(chunks, lambda: s.length - len(s.prompt) >= 8)
        server.kill()
        shown += pull_until(chunks, lambda: s.stats.offline_tokens >= 8)
        calls = s.stats.verify_calls
        server.start().wait_ready()
        assert s.wait_for_link(60)
        shown += list(chunks)
        assert s.stats.reconnects == 1 and s.stats.verify_calls > calls  # later tokens are verified again
        assert "lost session" in caplog.text  # a restarted server: the transcript was prefilled again
        assert s.result.token_ids == reference  # greedy + verify: exactly the target's text
        assert apply(shown) == s.result.text
        assert s.stats.rewound_tokens > 0 and any(c.rewind for c in shown)


def test_dropped_link_resumes_with_keep(env, api, caplog):
    caplog.set_level(logging.INFO, "moa.edge")
    with session(env, row_dtype="int8", backoff_s=FAST_BACKOFF) as s:
        chunks = s.generate(PROMPT, max_new_tokens=NEW, drop_after=8, offline_for=1.0)
        shown = pull_until(chunks, lambda: s.stats.offline_tokens >= 6)
        assert not s.online and s.wait_for_link(30)
        offline_end, sent = len(s.tokens), len(s.tokens) - s.length  # the pending root and the offline tokens
        shown += list(chunks)
        kept = s.tokens[:offline_end]
        assert s.stats.reconnects == 1 and s.stats.rewound_tokens == 0 and f"kept {sent} of {sent}" in caplog.text
        assert s.result.token_ids[:offline_end - len(s.prompt)] == kept[len(s.prompt):]  # the offline text stands
        # after the resume, the target's greedy continuation of the kept transcript, verified again
        rest = s.result.token_ids[offline_end - len(s.prompt):]
        assert api.complete(kept, max_new_tokens=len(rest)).token_ids == rest
        assert apply(shown) == s.result.text


def test_guard_shapes_offline_tokens_only(env, reference):
    """A guard that crushes every token of the last 64 and bans repeats offline: verified text is still the target's,
    offline text obeys it."""
    assert len(set(reference)) < len(reference)  # the target repeats tokens: a guard applied online would show
    strict = OfflineGuard(no_repeat_ngram=1, repetition_penalty=50.0)
    with session(env, offline_guard=strict) as s:
        assert s.complete(PROMPT, max_new_tokens=NEW).token_ids == reference
        chunks = list(s.generate(PROMPT, max_new_tokens=NEW, drop_after=8))
        verified = s.length - len(s.prompt) + 1  # the pending root is the target's too
        out = s.result.token_ids
        assert out[:verified] == reference[:verified] and s.stats.offline_tokens == len(out) - verified > 0
        stretch = out[verified - 1:]  # the root on
        assert len(set(stretch)) == len(stretch)
        assert chunks[-1].offline and apply(chunks) == s.result.text


def test_verify_resume_keeps_the_agreeing_offline_tokens_in_one_request(env, reference, caplog):
    caplog.set_level(logging.INFO, "moa.edge")
    with session(env, on_reconnect="verify", backoff_s=FAST_BACKOFF) as s:
        chunks = s.generate(PROMPT, max_new_tokens=NEW, drop_after=8, offline_for=0.5)
        shown = pull_until(chunks, lambda: s.stats.offline_tokens >= 6)
        assert s.wait_for_link(30)
        at, sent = s.length - len(s.prompt), s.tokens[s.length:]  # the pending root and the offline tokens
        shown += list(chunks)
        kept = len(sent) - s.stats.rewound_tokens
        assert kept == common_prefix(sent, reference[at:at + len(sent)]) >= 1  # up to the first disagreement
        assert f"kept {kept} of {len(sent)}" in caplog.text
        assert s.result.token_ids == reference and apply(shown) == s.result.text
        # one prefill, the verifies, and a single resume request brought the server back in step
        assert s.stats.reconnects == 1 and s.stats.retries == 0
        assert s.stats.server_calls == 2 + s.stats.verify_calls


@pytest.mark.parametrize("guard", [[], ["--no-repeat-ngram", "0", "--max-newlines", "0", "--no-copy"]], ids=["guard", "none"])
def test_offline_cli_guard(env, guard):
    out = edge_cli(PROMPT, "--bundle", str(env["bundle"]), "--mode", "offline", "--max-new-tokens", "40", "--json",
                   "--no-repeat-ngram", "2", *guard)
    assert out.returncode == 0, out.stderr
    tokens = json.loads(out.stdout)["token_ids"]
    bigrams = list(zip(tokens, tokens[1:]))
    assert (len(set(bigrams)) == len(bigrams)) == (not guard)  # the plain drafter loops; the guarded one never repeats


def test_offline_mode_needs_no_server(env):
    out = edge_cli(PROMPT, "--bundle", str(env["bundle"]), "--server", f"ws://127.0.0.1:{free_port()}", "--mode",
                   "offline", "--max-new-tokens", "16", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    stats = result["stats"]
    assert len(result["token_ids"]) == stats["new_tokens"] == stats["offline_tokens"] == 16
    assert stats["server_calls"] == 0 and stats["mode"] == "offline"


# ---- clear errors before generation ---------------------------------------------------------------------------
def test_wrong_token(env):
    out = edge_cli(PROMPT, "--bundle", str(env["bundle"]), "--server", env["main"].url, "--token", "wrong")
    assert out.returncode == 1 and out.stdout == ""
    assert "rejected the token" in out.stderr and "--token" in out.stderr
    with pytest.raises(ServerError) as info:
        EdgeSession(env["bundle"], env["main"].url, None, threads=1)
    assert info.value.code == P.E_AUTH


def test_bundle_for_another_model_is_refused(env, tmp_path):
    bundle = shutil.copytree(env["bundle"], tmp_path / "bundle")
    meta = json.loads((bundle / "bundle.json").read_text())
    meta["fingerprint"] = meta["fingerprint"].replace("memory=", "memory=0")
    (bundle / "bundle.json").write_text(json.dumps(meta))
    out = edge_cli(PROMPT, "--bundle", str(bundle), "--server", env["main"].url, "--token", TOKEN)
    assert out.returncode == 1 and out.stdout == ""
    assert "fingerprint" in out.stderr and "memory differ" in out.stderr
