"""The single-device benchmark: Spec-Bench prompts, multi-turn chats, results.json / results.md / PNG end to end.
(The client-server benchmark runs against a real server in test_client.py.)"""

import json
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.prompts import Prompt, PromptsError, builtin_prompts, humaneval_prompts, read_prompts
from bench.runs import Run, run_chat
from bench.single import METHODS, engine_turn, summarize
from models.data import iter_source
from models.defaults import resolve_drafter_path
from models.engine import GenerationResult, GenerationStats
from tests.helpers import train_tiny

DATASETS = Path(__file__).resolve().parents[1] / "datasets"

FIGURES = {"tau", "tau_speculating", "tokens_per_s", "tokens_per_s_median", "speedup", "target_forwards_per_token",
           "outputs_match_vanilla"}
SETTINGS = {"machine", "threads", "torch", "tree", "max_new_tokens", "temperature", "n_prompts", "target", "drafters",
            "date"}


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture
def two_prompts(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", [
        {"question_id": 1, "category": "writing", "turns": ["hello there", "and now?"]},
        {"question_id": "q2", "category": "qa", "turns": ["what is it"]},
    ])


def test_spec_bench_multi_turn_parsing(two_prompts, tmp_path):
    prompts = read_prompts(two_prompts)
    assert prompts == [Prompt("1", "writing", ["hello there", "and now?"]), Prompt("q2", "qa", ["what is it"])]
    no_category = write_jsonl(tmp_path / "c.jsonl", [{"question_id": 7, "turns": ["hi"]}])
    assert read_prompts(no_category)[0].category == "default"
    code = humaneval_prompts()
    assert len(code) == 82 and code[0].category == "code" and "def has_close_elements" in code[0].turns[0]
    heldout = builtin_prompts("sharegpt")  # shipped: the split the default drafters never saw
    record = json.loads((resolve_drafter_path("moa") / "training_record.json").read_text())
    assert len(heldout) == record["legs"][0]["data"]["heldout_ids"] and all(p.category == "sharegpt" for p in heldout)
    # the shipped training data holds none of the benchmark's prompts (sampled ids end in @tT)
    files = [f for f in DATASETS.glob("smollm2-*.jsonl.gz") if f.name != "smollm2-heldout.jsonl.gz"]
    assert len(files) >= 5
    trained = {str(row["id"]).split("@")[0] for f in files for row in iter_source(str(f))}
    assert trained and not trained & {p.question_id.removeprefix("onpolicy-") for p in heldout + code}


def test_turns_run_as_one_chat():
    class Recorder:
        def __init__(self):
            self.seen = []

        def generate(self, messages, **kw):
            self.seen.append([dict(m) for m in messages])
            stats = GenerationStats(new_tokens=2, target_forwards=2, acceptance_lengths=[2], total_s=0.5,
                                    predicted_s=0.1 * (len(messages) + 2))  # predicted: 0.1 s a token
            return GenerationResult(f"answer {len(self.seen)}", [5, 6], stats, "eos")

        def encode(self, messages):
            return [1] * len(messages)

    engine = Recorder()
    run = run_chat(engine_turn(engine, seed=0, max_new_tokens=4), "vanilla", Prompt("1", "c", ["first", "second"]))
    assert engine.seen[1] == [{"role": "user", "content": "first"}, {"role": "assistant", "content": "answer 1"},
                              {"role": "user", "content": "second"}]
    assert run.texts == ["answer 1", "answer 2"] and run.token_ids == [[5, 6], [5, 6]]
    assert run.totals["new_tokens"] == 4 and run.totals["rounds"] == 2 and run.totals["gained"] == 4
    assert run.totals["predicted_s"] == pytest.approx(0.1 * (1 + 2 + 3 + 2))


@pytest.mark.parametrize("row, problem", [
    ({"question_id": 1, "category": "x"}, "'turns'"),
    ({"question_id": 1, "turns": []}, "'turns'"),
    ({"category": "x", "turns": ["hi"]}, "'question_id'"),
])
def test_bad_prompts_file_is_a_clear_error(tmp_path, row, problem):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question_id": 0, "turns": ["fine"]}, row])
    with pytest.raises(PromptsError, match=rf"bad.jsonl:2: .*{problem}"):
        read_prompts(path)
    with pytest.raises(SystemExit, match="bad.jsonl:2"):
        main(["single", "--prompts", str(path), "--out", str(tmp_path / "out"), "--target", "tiny"])


def test_the_bench_cli_says_what_the_user_can_fix_and_keeps_a_bugs_traceback(two_prompts, tmp_path, monkeypatch):
    import bench.__main__ as cli
    from bench.runs import BenchError

    with pytest.raises(SystemExit, match="error: unknown model 'no/such-model'"):
        main(["single", "--prompts", str(two_prompts), "--target", "no/such-model", "--out", str(tmp_path / "a")])
    monkeypatch.setattr(cli, "benchmark", lambda args: (_ for _ in ()).throw(BenchError("2 of 4 clients failed")))
    with pytest.raises(SystemExit, match="error: 2 of 4 clients failed"):
        main(["single", "--prompts", str(two_prompts), "--target", "tiny", "--out", str(tmp_path / "b")])
    monkeypatch.setattr(cli, "benchmark", lambda args: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="shape mismatch"):  # a bug is not turned into a one-line message
        main(["single", "--prompts", str(two_prompts), "--target", "tiny", "--out", str(tmp_path / "c")])


def test_bench_end_to_end(tiny, two_prompts, tmp_path):
    for arch in ("moa", "eagle"):
        train_tiny(tiny, arch, steps=30).save_pretrained(tmp_path / arch)
    out = tmp_path / "bench"
    main(["single", "--prompts", str(two_prompts), "--methods", "vanilla,lookup,moa,vanilla+copy,eagle+copy",
          "--max-new-tokens", "16",
          "--out", str(out), "--target", "tiny", "--dtype", "float64", "--moa", str(tmp_path / "moa"),
          "--eagle", str(tmp_path / "eagle"), "--tree", "4,2,8", "--no-progress"])
    results = json.loads((out / "results.json").read_text())
    settings = results["settings"]
    assert SETTINGS <= set(settings) and settings["n_prompts"] == 2
    assert settings["tree"] == {"vanilla": "none", "lookup": "4,2,8", "moa": "4,2,8", "vanilla+copy": "none",
                                "eagle+copy": "4,2,8"}
    assert settings["rounds_by_tree"] == {}  # given trees are not tuned
    assert {"platform", "processor", "cpu_count"} <= set(settings["machine"])
    assert set(settings["drafters"]) == {"moa", "eagle"}
    assert list(results["methods"]) == ["vanilla", "lookup", "moa", "vanilla+copy", "eagle+copy"]
    for name, fig in results["methods"].items():
        assert name in METHODS and FIGURES <= set(fig)
        assert fig["outputs_match_vanilla"] == 1.0, name
        assert set(fig["per_category"]) == {"writing", "qa"}
        assert all(FIGURES <= set(c) for c in fig["per_category"].values())
        assert fig["tau_speculating"] >= fig["tau"] >= 1.0
    assert results["methods"]["vanilla"]["speedup"] == 1.0 and results["methods"]["vanilla"]["tau"] == 1.0
    assert (out / "results.png").stat().st_size > 0
    table = (out / "results.md").read_text()
    assert "| moa | all |" in table and "| eagle+copy | qa |" in table
    copies = {m: f["copy_round_share"] for m, f in results["methods"].items()}
    assert copies["moa"] == 0 < min(copies["eagle+copy"], copies["vanilla+copy"]), copies
    assert len((out / "outputs.jsonl").read_text().splitlines()) == 10
    assert len(read_prompts(out / "prompts.jsonl")) == 2


def test_single_tau_speculating_leaves_out_the_plain_rounds():
    """A drafter that gains 3 tokens a round where it speculates, decoded plainly in a third of its rounds, has tau
    7/3 over all rounds and 3 where used; one never used has no tau of its own."""
    def run(rounds: int, plain: int, gained: int) -> Run:
        return Run("q", "c", "moa", totals={"new_tokens": gained, "total_s": 1.0, "rounds": rounds,
                                            "plain_rounds": plain, "gained": gained})

    fig = summarize([run(4, 4, 4), run(8, 0, 24)])
    assert fig["tau"] == 28 / 12 and fig["tau_speculating"] == 3.0 and fig["plain_round_share"] == 4 / 12
    assert summarize([run(5, 5, 5)])["tau_speculating"] is None


def test_the_report_names_the_rounds_each_tuned_tree_ran():
    from bench.report import settings_line

    settings = {"benchmark": "single", "target": "t", "machine": {"processor": "cpu"}, "threads": 1, "device": "cpu",
                "dtype": "float32", "torch": "2", "n_prompts": 8, "max_new_tokens": 128, "temperature": 0.0,
                "date": "today", "tree": {"vanilla": "none", "eagle": "4,4,16", "moa": "3,4,12"},
                "rounds_by_tree": {"moa": {"4,8,32": 12, "3,4,12": 30}}}
    assert "trees (depth,topk,total): eagle 4,4,16, moa 4,8,32 (12 rounds) / 3,4,12 (30 rounds);" in \
        settings_line({"settings": settings})


def test_link_profiles_and_the_proxy_delays_and_caps():
    """The emulated link adds its round trip to a small exchange and its bandwidth to a large one (lower bounds:
    the proxy sleeps for them; a slow machine only adds)."""
    import socket
    import threading
    import time

    from bench.link import PRESETS, LinkProfile, LinkProxy, parse_link

    assert parse_link("4g") == PRESETS["4g"] and parse_link("rtt=30,bw=5") == LinkProfile("rtt=30,bw=5", 30, 0, 5)
    assert parse_link("rtt=7,jitter=2").bandwidth_mbit is None
    for bad in ("5g", "rtt=x", "bw=10", "rtt=-1", "rtt=5,bw=0", "rtt=5,loss=1"):
        with pytest.raises(ValueError):
            parse_link(bad)
    server = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        conn, _ = server.accept()
        while data := conn.recv(1 << 16):
            conn.sendall(data)
        conn.close()

    threading.Thread(target=echo, daemon=True).start()
    with LinkProxy("127.0.0.1", server.getsockname()[1], parse_link("rtt=40,bw=8,jitter=10")) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.listen_port)) as s:
            for n, at_least in ((10, 0.035), (500_000, 0.5)):  # rtt - jitter; 4 Mbit over 8 Mbit/s
                start, got = time.perf_counter(), 0
                s.sendall(b"x" * n)
                while got < n:
                    got += len(s.recv(1 << 20))
                assert time.perf_counter() - start >= at_least
    assert proxy.bytes == {"up": 500_010, "down": 500_010}
    server.close()


def test_target_builds_side_by_side(two_prompts, tmp_path):
    out = tmp_path / "targets"
    main(["targets", "--prompts", str(two_prompts), "--builds", "fp32,fp32-mkl,bf16", "--max-new-tokens", "6",
          "--target", "tiny", "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    builds = results["targets"]
    assert list(builds) == ["fp32", "fp32-mkl", "bf16"] and results["settings"]["reference"] == "fp32"
    assert builds["fp32"]["top1_agreement"] == 1.0 and builds["fp32"]["identical_outputs"] == 1.0
    assert builds["bf16"]["weights_mib"] < builds["fp32"]["weights_mib"]
    for f in builds.values():
        assert f["tokens_per_s"] > 0 and set(f["verify_ms"]) == {"1", "2", "5", "9", "17"}
        assert f["call_shape"]["positions"] > 0
    assert builds["fp32"]["call_shape"]["max_logit_diff"] < 1e-4
    assert "| bf16 |" in (out / "results.md").read_text()
    with pytest.raises(SystemExit):
        main(["targets", "--prompts", str(two_prompts), "--builds", "fp16", "--target", "tiny", "--out", str(out)])
