"""How much of ATen runs natively on tpu.

    python -m torch_pjrt.coverage                       # lowered ops, OpInfo pass rates
    python -m torch_pjrt.coverage --script train.py --epochs 1
                                      # + the ops train.py (run with --epochs 1) ran on the CPU

The OpInfo pass rates come from the last recorded run of tests/test_opinfo.py, which
writes .torch_pjrt_coverage/opinfo.json at the repository root (runs of parts of the
suite are merged into it). The pass rate is passed / (passed + failed + xfailed).
"""

import argparse
import json
import os
import runpy
import sys
from pathlib import Path

import torch_pjrt

RECORD = Path(".torch_pjrt_coverage") / "opinfo.json"
RECORD_COMMAND = "python -m pytest tests/test_opinfo.py   (add -m slow for the other dtypes)"


def default_results():
    """The recorded OpInfo run: in the current directory or a parent, else the checkout
    this package was built from."""
    here = Path.cwd().resolve()
    for d in (here, *here.parents, Path(__file__).resolve().parents[2]):
        if (d / RECORD).is_file():
            return d / RECORD
    return here / RECORD


def lowered_aten_ops():
    return sorted(n for n in torch_pjrt.lowered_ops() if n.startswith("aten::"))


def pass_rates(path):
    """[(dtype, direction, counts)] from a recorded run; None when there is none."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    rows = []
    for dtype, dirs in sorted(doc.get("results", {}).items()):
        for direction, r in sorted(dirs.items()):
            counts = {k: int(r.get(k, 0)) for k in ("passed", "failed", "xfailed", "skipped",
                                                     "native")}
            rows.append((dtype, direction, counts))
    return rows


def format_pass_rates(path):
    rows = pass_rates(path)
    if rows is None:
        return [f"No OpInfo run recorded ({path} not found or unreadable).",
                f"Record one from the repository root with: {RECORD_COMMAND}"]
    lines = [f"OpInfo pass rate (from {path}):",
             f"  {'dtype':<9} {'direction':<9} {'passed':>7} {'native':>7} {'xfailed':>8} "
             f"{'failed':>7} {'skipped':>8} {'pass rate':>10}"]
    for dtype, direction, c in rows:
        ran = c["passed"] + c["failed"] + c["xfailed"]
        rate = f"{100 * c['passed'] / ran:.1f}%" if ran else "-"
        lines.append(f"  {dtype:<9} {direction:<9} {c['passed']:>7} {c['native']:>7} "
                     f"{c['xfailed']:>8} {c['failed']:>7} {c['skipped']:>8} {rate:>10}")
    lines.append("  pass rate = passed / (passed + failed + xfailed); native: passed without "
                 "the CPU fallback")
    return lines


def run_script(argv):
    """Runs argv[0] as __main__ with argv[1:] as its arguments; returns its exit status."""
    path = argv[0]
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def fallback_table(ops, top):
    """Lines naming the ops that fell back most often, from metrics()["ops"]."""
    fell = sorted(((f, n, name) for name, (n, f) in ops.items() if f), reverse=True)
    if not fell:
        return ["No op fell back to the CPU."]
    native = sum(n for n, _ in ops.values())
    lines = [f"Ops that fell back to the CPU ({len(fell)} ops, {sum(f for f, _, _ in fell)} "
             f"fallback calls, {native} native calls):",
             f"  {'op':<48} {'fallback':>9} {'native':>8}"]
    for f, n, name in fell[:top]:
        lines.append(f"  {name:<48} {f:>9} {n:>8}")
    if len(fell) > top:
        lines.append(f"  ... {len(fell) - top} more (--top)")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m torch_pjrt.coverage", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=None,
                        help="the recorded OpInfo run (default: .torch_pjrt_coverage/opinfo.json"
                             " here or in a parent directory)")
    parser.add_argument("--top", type=int, default=20, help="fallback ops to list")
    parser.add_argument("--script", nargs=argparse.REMAINDER, metavar="PATH [ARGS]",
                        help="run this script (with its arguments) and list its CPU fallbacks; "
                             "comes last: everything after it goes to the script")
    args = parser.parse_args(argv)

    out = [f"Natively lowered ATen ops: {len(lowered_aten_ops())}", ""]
    out += format_pass_rates(args.results or default_results())
    print("\n".join(out), flush=True)
    if not args.script:
        return 0
    script = args.script
    torch_pjrt.reset_metrics()
    status = run_script(script)
    ops = torch_pjrt.metrics()["ops"]
    print("\n" + "\n".join([f"{script[0]} (exit status {status}):",
                            *fallback_table(ops, args.top)]))
    return status


if __name__ == "__main__":
    sys.exit(main())
