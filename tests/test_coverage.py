"""python -m torch_pjrt.coverage: lowered-op count, recorded OpInfo pass rates, and the
CPU fallbacks of a script."""

import json
import re
import subprocess
import sys
import textwrap

import conftest

from torch_pjrt import coverage

# An op of our own with only a CPU kernel: it can only ever run through the fallback.
SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch_pjrt

    lib = torch.library.Library("covtest", "DEF")
    lib.define("twice(Tensor x) -> Tensor")
    lib.impl("twice", lambda x: x * 2, "CPU")
    x = torch.ones(3, device="tpu") + 1
    assert torch.ops.covtest.twice(x).device.type == "tpu"
    print("script args:", sys.argv[1:])
""")


def test_script_fallbacks(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(SCRIPT)
    missing = tmp_path / "none.json"
    r = subprocess.run(
        [sys.executable, "-m", "torch_pjrt.coverage", "--results", str(missing),
         "--script", str(script), "--flag", "x"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    n = re.search(r"Natively lowered ATen ops: (\d+)", r.stdout)
    assert n and int(n.group(1)) > 100, r.stdout
    assert "No OpInfo run recorded" in r.stdout and "tests/test_opinfo.py" in r.stdout
    assert "script args: ['--flag', 'x']" in r.stdout
    fell = r.stdout.split("fell back to the CPU", 1)[1]
    assert "covtest::twice" in fell
    assert "aten::add" not in fell  # ran natively: counted, not listed


def test_script_exit_status(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    r = subprocess.run([sys.executable, "-m", "torch_pjrt.coverage", "--results",
                        str(tmp_path / "none.json"), "--script", str(script)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 3
    assert "No op fell back to the CPU." in r.stdout


def test_pass_rates_from_json(tmp_path, capsys):
    path = tmp_path / "opinfo.json"
    path.write_text(json.dumps({"results": {
        "bfloat16": {"forward": {"passed": 3, "failed": 0, "xfailed": 1, "skipped": 5,
                                 "native": 2, "tests": {}}},
        "float32": {"backward": {"passed": 0, "failed": 0, "xfailed": 0, "skipped": 2}},
    }}))
    assert coverage.main(["--results", str(path)]) == 0
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:2]): line.split() for line in out.splitlines()
            if line.startswith("  ") and len(line.split()) == 8}
    assert rows[("bfloat16", "forward")] == ["bfloat16", "forward", "3", "2", "1", "0", "5",
                                             "75.0%"]
    assert rows[("float32", "backward")][-1] == "-"


def test_recorded_run_is_merged_and_read(tmp_path, monkeypatch, request, capsys):
    """conftest's session hook merges runs into the JSON that coverage reads."""
    path = tmp_path / "cov" / "opinfo.json"
    monkeypatch.setattr(conftest, "OPINFO_JSON", path)
    # Runs are recorded at the default sample count (the suite may run with fewer).
    monkeypatch.setattr(request.config.option, "opinfo_samples", 8)
    run1 = {"a": ("abs", "bfloat16", "forward", "passed", []),
            "b": ("sin", "bfloat16", "forward", "failed", None)}
    run2 = {"c": ("sin", "bfloat16", "forward", "passed", ["aten::sin"]),
            "d": ("cos", "float16", "forward", "xfailed", None)}
    for run in (run1, run2):
        monkeypatch.setattr(conftest, "_OPINFO_RESULTS", run)
        conftest.pytest_sessionfinish(request.session)
    doc = json.loads(path.read_text())
    bf16 = doc["results"]["bfloat16"]["forward"]
    assert (bf16["passed"], bf16["failed"], bf16["native"]) == (2, 0, 1)
    assert bf16["tests"]["sin"] == {"outcome": "passed", "fallbacks": ["aten::sin"]}
    assert doc["results"]["float16"]["forward"]["xfailed"] == 1
    rates = {(d, k): c for d, k, c in coverage.pass_rates(path)}
    assert rates[("float16", "forward")]["xfailed"] == 1
    coverage.main(["--results", str(path)])
    assert "100.0%" in capsys.readouterr().out
