"""Every ``plexus`` command in the README's ```sh blocks runs, and does what its comment says.

The commands are read from README.md itself, so an example cannot drift from the code:

- each is run as written, in a scratch folder, shortened by ``--steps 60`` appended, except
  an example with a kill or a schedule (``@step=N``, ``--warmup-steps N``), which keeps its
  length as written so that the test shows it fires there, and one that stops on a target;
  plus ``--out`` where it has none and ``--json`` to read the summary;
- the effect its comment states is checked (``EFFECTS``): a kill happened (the job failed
  naming the process, or the survivors finished and the summary lists it as lost), a
  target was reached, and so on; every other command must simply succeed;
- the commands not run are listed in ``SKIP`` with the reason (a second terminal, a fixed
  port, a benchmark that takes minutes, an example another test runs), and the list cannot
  go stale: each entry must still match a command of the README;
- the measured tables live in ``docs/results/``, not in the README: each page names its
  command and date and the README links it, and every link to a file resolves.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# Commands not run, by a piece of their text, with the reason.
SKIP = {
    "plexus bench ddp": "a benchmark (minutes of timed rounds); tests/test_bench_ddp.py runs it shortened",
    "plexus bench collectives": "a benchmark of 64 MB all-reduces; tests/test_collectives.py covers the algorithms",
    "plexus bench defaults": "trains every strategy on two datasets (minutes); tests/test_defaults_matrix.py",
    "plexus bench startup": "times 18 jobs; tests/test_startup.py runs it with one row",
    "--port 29500": "the background half of a two-terminal example on a fixed port; tests/test_ps_join.py runs "
                    "the same pair on a free port",
    "plexus worker --join": "needs the job above running in another terminal; tests/test_ps_join.py",
    "plexus server --join": "needs a ps job running in another terminal; tests/test_ps_replication.py runs the "
                            "join and the drain against a job on a free port",
    "plexus drain": "needs a ps job running in another terminal; tests/test_ps_replication.py",
    "--lbfgs vector-free --line-search strong_wolfe": "tests/test_sandblaster.py runs vector-free and strong Wolfe "
                                                      "against torch.optim.LBFGS",
    "--simulate --sim-workers 64": "15 simulated jobs of 64 workers (about a minute); tests/test_simulate.py runs "
                                   "compare --simulate --seeds 2 on two specs",
    "plexus reproduce": "a paper reproduction (15-60 s); tests/test_simulate.py runs one recipe with --quick",
    "--strategy sandblaster --workers 3 --slow": "tests/test_sandblaster.py runs a slow replica and counts its units",
}

# The effect a comment states -> what the test checks (see _check).
EFFECTS = [
    (re.compile(r"the job fails, naming (worker|server|aggregator) (\d+)"), "fails naming"),
    (re.compile(r"goes on without it|subtree is lost|is dropped|survivors"), "lost"),
    (re.compile(r"[Ss]top when a snapshot reaches"), "target"),
]


@dataclass
class Example:
    line: int  # README line where the command starts
    text: str  # the command as written (continuations joined)
    comment: str  # its trailing comment and the comment lines just above it
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)


def examples(readme: Path = README) -> tuple[list[Example], list[str], list[str]]:
    """(plexus commands, other commands, TOML blocks) of the README's code blocks."""
    lines = readme.read_text().splitlines()
    found: list[Example] = []
    others: list[str] = []
    tomls: list[str] = []
    i = 0
    while i < len(lines):
        fence = lines[i].strip()
        if fence.startswith("```toml"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            tomls.append("\n".join(lines[i + 1:end]))
            i = end + 1
            continue
        if fence != "```sh":
            i += 1
            continue
        variables: dict[str, str] = {}
        above: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            start, text = i + 1, lines[i]
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1].rstrip() + " " + lines[i].strip()
            i += 1
            stripped = text.strip()
            if not stripped:
                above = []
                continue
            if stripped.startswith("#"):
                above.append(stripped.lstrip("# "))
                continue
            command, _, comment = stripped.partition(" #")
            words = shlex.split(command.replace("$SPECS", variables.get("SPECS", "")).rstrip("& "))
            env = {}
            while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            if not words:
                variables.update(env)  # SPECS="..." for the commands below
                continue
            if words[0] != "plexus":
                others.append(stripped)
                continue
            found.append(Example(start, stripped, " ".join(above + [comment.strip()]), env, words[1:]))
        i += 1
    return found, others, tomls


def _skip_reason(example: Example) -> str | None:
    return next((why for key, why in SKIP.items() if key in example.text), None)


def test_every_readme_command_is_run_or_skipped_with_a_reason():
    """Cheap: the README parses, and the skip list names only commands that exist."""
    found, others, _ = examples()
    assert len(found) >= 25, [e.text for e in found]
    for key in SKIP:
        assert any(key in e.text for e in found), f"SKIP entry {key!r} matches no README command any more"
    run = [e for e in found if _skip_reason(e) is None]
    assert len(run) >= 15, [e.text for e in run]
    # The commands that are not plexus: the Makefile's (the suite itself is `make test`) and torchrun's
    # (tests/test_cli.py::test_torchrun_runs_the_same_job).
    assert all(o.startswith(("make ", "PLEXUS_TOKEN=s3cret torchrun")) for o in others), others


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_readme_link_to_a_file_points_at_one():
    """A link of the README (or of a page under docs/) to a file of the repository, with its
    #anchor if it has one, names a file and a heading that exist."""
    broken = []
    for page in [README, *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)}
                if anchor not in slugs:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


def test_every_results_page_names_its_command_and_date_and_is_linked():
    """docs/results/*.md hold the measured tables: each names the command that produced it
    (a plexus command or a benchmarks/ script) and the date it was measured, has a table,
    and the README links it."""
    readme = README.read_text()
    pages = sorted((ROOT / "docs" / "results").glob("*.md"))
    assert pages
    problems = []
    for page in pages:
        text, name = page.read_text(), page.relative_to(ROOT)
        command = r"(`|^)(plexus (bench|train|compare|simulate|reproduce) |python benchmarks/\w+\.py)"
        if not re.search(command, text, flags=re.M):
            problems.append(f"{name}: names no command (plexus bench/train/compare/simulate/reproduce or "
                            f"python benchmarks/*.py)")
        if not re.search(r"\b20\d\d-\d\d-\d\d\b", text):
            problems.append(f"{name}: no date (YYYY-MM-DD)")
        if not re.search(r"^\|.*\|\s*$\n^\|[\s:|-]+\|\s*$", text, flags=re.M):
            problems.append(f"{name}: no table")
        if f"]({name})" not in readme:
            problems.append(f"{name}: the README does not link it")
    assert not problems, "\n".join(problems)


def _longest_schedule(argv: list[str]) -> int:
    """The largest step any flag of ``argv`` names (a kill, a warm-up)."""
    steps = [int(n) for a in argv for n in re.findall(r"@step=(\d+)", a)]
    for flag in ("--warmup-steps",):
        if flag in argv:
            steps.append(int(argv[argv.index(flag) + 1]))
    return max(steps, default=0)


def _shortened(example: Example, out: Path) -> list[str]:
    argv = list(example.argv)
    command = argv[0]
    if command in ("train", "compare", "simulate"):
        # A run that stops on a target keeps its length, and so does one with a kill or a
        # schedule: its length as written (the default: one epoch or 300 steps) must let
        # it fire. Every other run is cut to 60 steps.
        if "--target-accuracy" not in argv and not _longest_schedule(argv):
            argv += ["--steps", "60"]
        if "--out" not in argv:
            argv += ["--out", str(out)]
        argv.append("--json")
    return argv


def _summaries(stdout: str) -> list[dict]:
    last = stdout.strip().splitlines()[-1] if stdout.strip() else "null"
    data = json.loads(last) if last.startswith(("{", "[")) else None
    return [] if data is None else data if isinstance(data, list) else [data]


def _check(example: Example, result: subprocess.CompletedProcess, out_dir: Path) -> str | None:
    """None when ``example`` did what its comment says; else what went wrong."""
    said = f"README line {example.line}: {example.text}\n  exit {result.returncode}; stderr tail: " \
           f"{result.stderr.strip().splitlines()[-3:]}"
    effect = next(((kind, m) for pattern, kind in EFFECTS if (m := pattern.search(example.comment))), None)
    kills = [a for i, a in enumerate(example.argv) if "@step=" in a and example.argv[i - 1] == "--kill"]
    drains = [a for i, a in enumerate(example.argv) if example.argv[i - 1] == "--drain"]
    if effect and effect[0] == "fails naming":
        role, rank = effect[1].group(1), effect[1].group(2)
        if result.returncode == 0 or f"{role} {rank}" not in result.stderr:
            return f"{said}\n  the comment says the job fails naming {role} {rank}"
        summary = json.loads((out_dir / "summary.json").read_text()) if (out_dir / "summary.json").exists() else {}
        if summary.get("status") not in ("failed", None):
            return f"{said}\n  a failed job's summary says status {summary.get('status')!r}"
        return None
    if result.returncode != 0:
        return said
    if example.argv[0] == "report":
        return None if (out_dir / "index.html").exists() else f"{said}\n  no index.html in {out_dir}"
    if "--print-partition" in example.argv:  # prints the plan and trains nothing
        return None if "transfers" in result.stdout else f"{said}\n  no partition plan on stdout"
    summaries = _summaries(result.stdout)
    if example.argv[0] in ("train", "compare", "simulate") and not summaries:
        return f"{said}\n  no JSON summary on stdout"
    for summary in summaries:
        if summary.get("status", "completed") != "completed":
            return f"{said}\n  status {summary.get('status')!r}"
    if kills or (effect and effect[0] == "lost"):
        # A kill that fired in a job that outlives it: the summary names what was lost.
        (summary,) = summaries
        lost = summary.get("lost_workers") or []
        others = {k: v for k, v in summary.items() if k.startswith("lost_") and k != "lost_workers" and v}
        if not lost and not others:
            return f"{said}\n  the kill never fired: lost_workers {lost}, {others}"
        for kill in kills:
            m = re.match(r"(worker|server|aggregator):(\d+)@", kill)
            if m and m.group(1) == "worker" and int(m.group(2)) not in lost:
                return f"{said}\n  worker {m.group(2)} was to be killed, lost_workers is {lost}"
            if m and m.group(1) != "worker" and f"{m.group(1)} {m.group(2)}" not in json.dumps(summary):
                return f"{said}\n  the summary does not name the killed {m.group(1)} {m.group(2)}"
    if drains:
        (summary,) = summaries
        if not summary.get("migrations"):
            return f"{said}\n  the drain never moved a shard: no migrations in the summary"
    if "--warmup-steps" in example.argv:
        # Issue 19: a warm-up as long as the run left local SGD with no averaging at all.
        (summary,) = summaries
        if summary.get("averagings") is not None and summary["averagings"] <= 0:
            return f"{said}\n  no averaging after the warm-up: averagings {summary['averagings']}"
    if effect and effect[0] == "target":
        (summary,) = summaries
        if summary.get("time_to_target_seconds") is None:
            return f"{said}\n  the target was not reached (final {summary.get('final_test_accuracy')})"
    return None


def _user_package(folder: Path) -> None:
    """``mypkg.nets:make_model`` and ``mypkg.data:make_data`` as "Your own model and data"
    describes them, in the folder the command runs from (which must be importable)."""
    pkg = folder / "mypkg"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(
        "from torch import nn\n\n"
        "def make_model(data):\n"
        "    return nn.Sequential(nn.Linear(data.input_shape[0], 16), nn.Tanh(), nn.Linear(16, data.num_classes))\n")
    (pkg / "data.py").write_text(
        "import torch\n\n"
        "def make_data(cfg, seed):\n"
        "    gen = torch.Generator().manual_seed(seed)\n"
        "    y = torch.randint(0, 2, (600,), generator=gen)\n"
        "    x = torch.randn(600, 8, generator=gen) + 2.0 * y[:, None].float()\n"
        "    return x[:500], y[:500], x[500:], y[500:]\n")


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``plexus ARGV`` as the console script runs it (``plexus.cli.main``), in this process:
    a fresh interpreter per example would import torch 23 times (about a minute of the
    suite); the console script itself is tested in test_cli.py."""
    import contextlib
    import io
    from plexus.cli import main
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd, saved_path = dict(os.environ), os.getcwd(), list(sys.path)
    os.environ.update(env)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


@pytest.mark.slow
def test_every_readme_example_does_what_its_comment_says(tmp_path):
    found, _, tomls = examples()
    job_toml = next((t for t in tomls if "job.toml" in t), None)
    # The tour's `--config job.toml`: the file the README shows, else the tour's first job.
    (tmp_path / "job.toml").write_text(job_toml or 'strategy = "allreduce"\nalgorithm = "ring"\nworkers = 4\n'
                                                   'dataset = "digits"\nmodel = "mlp"\n')
    _user_package(tmp_path)
    env = {"PLEXUS_PROGRESS_EVERY": "60"}
    failures, ran, timings = [], [], []
    train_outs: list[Path] = []
    for n, example in enumerate(found):
        if _skip_reason(example) is not None:
            continue
        out = tmp_path / "out" / f"{n:02d}"
        out.parent.mkdir(exist_ok=True)
        if example.argv[0] == "report":
            # `runs/a runs/b` stand for two run directories: the first two this test made.
            for name, src in zip([a for a in example.argv[1:] if not a.startswith("-")][:2], train_outs):
                if not (tmp_path / name).exists():
                    shutil.copytree(src, tmp_path / name)
        argv = _shortened(example, out)
        started = time.monotonic()
        result = _run(argv, tmp_path, {**env, **example.env})
        timings.append((time.monotonic() - started, example.text))
        ran.append(example.text)
        run_dir = tmp_path / argv[argv.index("--out") + 1] if "--out" in argv else out
        problem = _check(example, result, run_dir)
        if problem:
            failures.append(problem)
        elif example.argv[0] == "train" and (run_dir / "summary.json").exists():
            train_outs.append(run_dir)
    print("\n".join(f"{s:6.1f} s  {text}" for s, text in timings))
    assert not failures, "\n\n".join(failures)
    assert len(ran) >= 15
