"""The README and docs/: short front page, every headline and table equal to its result
file, every course problem under a heading that names it, every link resolving; and
make all's runner (progress lines, summary, a failing script not stopping the others)."""
import importlib.util
import json
import re
import shutil
import stat
import sys


from conftest import ROOT

spec = importlib.util.spec_from_file_location("report", ROOT / "tools" / "report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Each course problem (../shared/PROBLEMS.md), as the heading in docs/ that answers it names it
COURSE = ["distributed_communication_single_node", "naive_ddp (a)", "naive_ddp_benchmarking (b)",
          "minimal_ddp_flat_benchmarking", "ddp_overlap_individual_parameters:",
          "ddp_overlap_individual_parameters_benchmarking (a)", "ddp_overlap_individual_parameters_benchmarking (b)",
          "ddp_overlap_bucketed", "ddp_bucketed_benchmarking (a)", "ddp_bucketed_benchmarking (b)",
          "communication_accounting (a)", "communication_accounting (b)", "communication_accounting (c)",
          "communication_accounting (d)", "optimizer_state_sharding:", "optimizer_state_sharding_accounting (a)",
          "optimizer_state_sharding_accounting (b)", "optimizer_state_sharding_accounting (c)",
          "(course problem 8)", "(course problem 9)", "(course problem 10)", "(course problem 11)",
          "(course problem 12)"]


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_every_headline_equals_its_result_file():
    text = (ROOT / "README.md").read_text()
    cells = dict(re.findall(r"<!-- headline:(\w+) -->(.*?)<!-- end -->", text))
    assert set(cells) == set(report.HEADLINES)
    for script, cell in cells.items():
        assert cell == report.headline(script), f"{script}: run `make docs`"
        assert "no results yet" not in cell


def test_every_injected_table_equals_its_result_file():
    for path in DOCS:
        text = path.read_text()
        assert report.injected(text) == text, f"{path.name} differs from results/: run `make docs`"


def test_a_changed_result_changes_the_headline_the_check_compares(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "results", results, ignore=shutil.ignore_patterns("*.png", "gpu"))
    doc = json.loads((results / "08_tensor_parallel.json").read_text())
    for r in doc["rows"]:
        if r.get("vs_torch") is not None:
            r["vs_torch"] *= 1.5
    (results / "08_tensor_parallel.json").write_text(json.dumps(doc))
    text = (ROOT / "README.md").read_text()
    assert report.injected(text, results) != text


def test_every_course_problem_has_a_heading_in_docs():
    headings = [line for path in DOCS[1:] for line in path.read_text().splitlines() if line.startswith("#")]
    for name in COURSE:
        assert any(name in h for h in headings), name


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_resolves():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if target.startswith("http"):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{path.name}: {target}"
            if anchor:
                anchors = {slug(line.lstrip("#")) for line in dest.read_text().splitlines() if line.startswith("#")}
                assert anchor in anchors, f"{path.name}: {target}"


def fake_make(tmp_path, failing):
    """A `make` that runs a target as a script would: prints a verification line, or fails."""
    exe = tmp_path / "make"
    exe.write_text(f"#!{sys.executable}\nimport sys\nt = sys.argv[-1]\nprint('running', t)\n"
                   f"if t in {failing!r}:\n    print('verify ' + t + ': FAIL'); sys.exit(1)\n"
                   f"print('verify ' + t + ': PASS')\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_make_all_shows_progress_keeps_going_after_a_failure_and_summarizes(tmp_path, capsys):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "results", results, ignore=shutil.ignore_patterns("*.png", "gpu", "SUMMARY.*"))
    doc = tmp_path / "page.md"
    doc.write_text("<!-- headline:03 -->old<!-- end -->\n")
    rc = report.run_all(["02", "03", "04"], fake_make(tmp_path, ["03"]), results, [doc])
    out, err = capsys.readouterr()
    assert rc == 1 and "03_flat_ddp" in err   # it names the script that failed
    assert "[1/3] 02_naive_ddp (no earlier run on this machine)" in out
    assert "[3/3] 04_overlap_ddp" in out and "running 04" in out   # the failure did not stop it
    summary = (results / "SUMMARY.md").read_text()
    assert re.search(r"\| 02_naive_ddp \| PASS \| communication .* \| 0 \|", summary)
    assert re.search(r"\| 03_flat_ddp \| FAIL \| failed: see its output above \| 1 \|", summary)
    assert "| all |" in summary
    assert doc.read_text().startswith("<!-- headline:03 -->verified: FAIL")
    report.run_all(["02"], fake_make(tmp_path, []), results, [doc])   # the next run knows how long 02 took
    assert "[1/1] 02_naive_ddp (about 1 min on this machine's last run)" in capsys.readouterr().out


def test_a_wall_time_rounds_to_whole_seconds_before_it_splits_into_minutes():
    assert [report.minutes(s) for s in (0.4, 59.6, 539.6, 600.0, 61.2)] == [
        "0 min 00 s", "1 min 00 s", "9 min 00 s", "10 min 00 s", "1 min 01 s"]
