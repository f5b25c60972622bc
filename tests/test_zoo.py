"""The model zoo's fixed CI sample (`python -m torch_pjrt.zoo --sample ci`): real Hugging
Face, timm and torchvision models built from their configs with random weights, run on tpu
and on the CPU. Every model that runs on the CPU must run on tpu and match it, in each eager
mode and compiled, with no CPU fallback. The model runs are marked `slow` (Strict's job only:
they start their own worker processes in each mode); the helpers' tests run in every job."""

import importlib.util
import os

import pytest

from torch_pjrt import zoo

pytestmark = [
    pytest.mark.skipif(
        not all(importlib.util.find_spec(m) for m in ("transformers", "timm", "torchvision")),
        reason="the zoo extra (transformers, timm, torchvision) is not installed"),
]

# Models of the sample that the CPU itself cannot run with the zoo's generic small config
# (not counted by the zoo either); the test checks that the list stays true.
CPU_ERRORS = set()
# Ops allowed to fall back, per model, with the reason.
KNOWN_FALLBACKS = {
    # torchvision's own detection ops (torchvision::nms, roi_align) have no lowering yet.
    "tv:fasterrcnn_mobilenet_v3_large_320_fpn": {"torchvision::nms", "torchvision::roi_align"},
}


def _check(records, names):
    assert [r["model"] for r in records] == list(names)
    bad = [r for r in records if r["status"] not in ("pass", "cpu_error")]
    assert not bad, "\n".join(f"{r['model']}: {r['status']} {r.get('error', '')} "
                              f"{r.get('max_rel', '')}" for r in bad)
    cpu = {r["model"] for r in records if r["status"] == "cpu_error"}
    assert cpu <= CPU_ERRORS, f"models fail on the CPU: {cpu - CPU_ERRORS}"
    fell = {r["model"]: sorted(set(r["fallbacks"]) - KNOWN_FALLBACKS.get(r["model"], set()))
            for r in records if r.get("fallbacks")}
    fell = {m: ops for m, ops in fell.items() if ops}
    assert not fell, f"CPU fallbacks: {fell}"
    counted = [r for r in records if r["status"] != "cpu_error"]
    assert len(counted) >= 60 or len(names) < 60


# Debug runs Strict's programs, one op at a time: `python -m torch_pjrt.zoo --mode debug`.
# Strict runs the whole CI sample; DeferAndFuse and compiled a fixed third of it each (other
# models in each), all of it with TORCH_PJRT_TEST_FULL=1 (CI time: compiled, the whole
# sample takes ~6 min on 2 cores).
FULL = os.environ.get("TORCH_PJRT_TEST_FULL") == "1"
MODE_SAMPLE = {"strict": zoo.CI_SAMPLE,
               "defer_and_fuse": zoo.CI_SAMPLE if FULL else zoo.CI_SAMPLE[0::3],
               "compile": zoo.CI_SAMPLE if FULL else zoo.CI_SAMPLE[1::3]}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["strict", "defer_and_fuse", "compile"])
def test_ci_sample_forward(mode, tmp_path):
    os.environ.setdefault("TORCH_TPU_CACHE_DIR", str(tmp_path / "cache"))
    names = MODE_SAMPLE[mode]
    _check(zoo.run(names, mode=mode, chunk=25, timeout=600, progress=False), names)


TRAIN_SAMPLE = ["hf-causal:llama", "hf-causal:gpt2", "hf-causal:qwen3_moe", "hf-s2s:t5",
                "hf:bert", "hf:vit", "timm:test_vit", "timm:resnet10t", "tv:mobilenet_v3_small",
                "tv:squeezenet1_1"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["strict", "compile"])
def test_training_sample(mode):
    # Compiled, a part of the sample (CI time); with the mixture of experts, whose compiled
    # backward once replayed the first step's grouped-matmul slicing.
    names = TRAIN_SAMPLE if mode == "strict" else ["hf-causal:llama", "hf-causal:gpt2",
                                                   "hf-causal:qwen3_moe", "hf-s2s:t5",
                                                   "timm:test_vit"]
    _check(zoo.run(names, mode=mode, task="train", progress=False), names)


GENERATE_SAMPLE = ["hf-causal:llama", "hf-causal:gpt2", "hf-causal:mixtral", "hf-s2s:t5",
                   "hf-s2s:bart", "hf-speech:whisper"]


@pytest.mark.slow
def test_generation_sample():
    _check(zoo.run(GENERATE_SAMPLE, task="generate", progress=False), GENERATE_SAMPLE)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--static"], ["--sample"]])
def test_generate_example(flags):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "examples" / "generate.py"
    check = [] if "--sample" in flags else ["--check"]
    r = subprocess.run([sys.executable, str(script), "--train-steps", "5", "--tokens", "8",
                        *flags, *check], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "8 tokens in" in r.stdout and "0 CPU fallback calls" in r.stdout
    if check:
        assert "tokens agree" in r.stdout


@pytest.mark.slow
def test_compiled_static_cache_decode_compiles_once():
    import copy

    import torch

    import torch_pjrt

    model, kw = zoo.build("hf-causal:llama")
    ids = kw["input_ids"][:1, :6]
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        want = model.generate(input_ids=ids, **gen)
        tpu = copy.deepcopy(model).to("tpu")
        tpu.forward = torch.compile(tpu.forward, backend="tpu")
        torch_pjrt.reset_metrics()
        assert torch.equal(tpu.generate(input_ids=ids.to("tpu"), **gen).cpu(), want)
        first = torch_pjrt.metrics()["compile"]
        # Prefill and one decode step: not one program per token.
        assert 1 <= first["compiled_graphs"] <= 2, first
        torch_pjrt.reset_metrics()
        assert torch.equal(tpu.generate(input_ids=ids.to("tpu"), **gen).cpu(), want)
        again = torch_pjrt.metrics()
        assert again["compile"].get("compiled_graphs", 0) == 0 and again["compilations"] == 0, again


def test_summary_counts_only_models_that_run_on_the_cpu():
    recs = [{"model": "a", "status": "pass"}, {"model": "b", "status": "mismatch"},
            {"model": "c", "status": "cpu_error"}, {"model": "d", "status": "error",
                                                    "fallbacks": {"aten::x": 1}}]
    s = zoo.summary(recs)
    assert s["run_on_cpu"] == 3 and s["match_pct"] == 33.3 and s["run_pct"] == 66.7


def test_compare_reports_the_largest_difference():
    import torch

    want = [torch.tensor([1.0, 100.0])]
    res = zoo.compare([torch.tensor([1.0, 100.5])], want, 1e-4)
    assert not res["ok"] and res["max_abs"] == pytest.approx(0.5)
    assert res["max_rel"] == pytest.approx(0.005)
    assert zoo.compare([torch.tensor([1.0, 100.0 + 1e-3])], want, 1e-4)["elementwise"]
    res = zoo.compare([torch.tensor([1.0, float("nan")])], want, 1e-4)
    assert not res["ok"] and "NaN" in res["why"]
    # Rounding of a 1e7 activation in a small output: off element by element only.
    big = [torch.tensor([3e7, 1.0])]
    res = zoo.compare([torch.tensor([3e7 + 2.0, 1.5])], big, 1e-4)
    assert res["ok"] and not res["elementwise"]
    assert not zoo.compare([torch.tensor([3e7, 2e4])], big, 1e-4)["ok"]


def test_resume_skips_the_models_an_interrupted_run_recorded(tmp_path, monkeypatch, capsys):
    import json

    ran = []

    def fake_run(names, mode, dtype, chunk, timeout, task, on_record):
        recs = []
        for n in names:
            ran.append(n)
            rec = {"model": n, "mode": mode, "dtype": dtype, "task": task, "status": "pass"}
            on_record(rec)
            recs.append(rec)
            if n == "hf:b" and len(ran) == 2:
                raise KeyboardInterrupt  # the first run stops after its second model
        return recs

    monkeypatch.setattr(zoo, "run", fake_run)
    out = tmp_path / "z.json"
    with pytest.raises(KeyboardInterrupt):
        zoo.main(["--models", "hf:a", "hf:b", "hf:c", "--json", str(out)])
    # Another task's records in the file are not this run's.
    with open(str(out) + ".jsonl", "a") as f:
        f.write(json.dumps({"model": "hf:c", "mode": "strict", "dtype": "float32",
                            "task": "train", "status": "pass"}) + "\n")
    zoo.main(["--models", "hf:a", "hf:b", "hf:c", "--json", str(out), "--resume"])
    assert ran == ["hf:a", "hf:b", "hf:c"]
    data = json.loads(out.read_text())
    assert [r["model"] for r in data["records"]] == ["hf:a", "hf:b", "hf:c"]
    assert data["summary"]["models"] == 3
    with pytest.raises(SystemExit):
        zoo.main(["--models", "hf:a", "--resume"])
    assert "--resume needs --json" in capsys.readouterr().err
