"""slmviz.progress: one bar per job that names its phase, never runs backwards, and says the time left."""

import pytest

from slmviz.progress import Progress, ProgressUpdate, as_progress, format_seconds


def collect(job="job"):
    seen: list[ProgressUpdate] = []
    return as_progress(seen.append, job), seen


def test_parts_lay_their_shares_end_to_end_and_name_their_phase():
    p, seen = collect("prepare")
    corpus = p.part("chat corpus", share=0.25)
    corpus.update(3, 9, unit="part")
    assert seen[-1].phase == "chat corpus" and seen[-1].fraction == pytest.approx(0.25 * 3 / 9)
    assert seen[-1].text().startswith("chat corpus 3 / 9 part")
    scan = p.part("scan", share=0.5, index=(2, 4))
    scan.update(1, 2, unit="doc")
    assert seen[-1].phase == "scan 2/4" and seen[-1].fraction == pytest.approx(0.25 + 0.5 * 0.5)


def test_a_count_that_restarts_never_pulls_the_bar_back():
    p, seen = collect()
    first = p.part("scan", 0.5, index=(1, 2))
    first.update(200, 200)
    p.part("scan", 0.5, index=(2, 2)).update(0, 200)
    first.update(54, 200)  # a late report of an earlier pass
    fractions = [u.fraction for u in seen]
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(0.5)


def test_a_sub_job_reports_into_its_callers_part():
    p, seen = collect()
    p.part("corpus", 0.5).finish()
    inner = as_progress(p.part("training", 0.5), "train_transcoders")
    assert isinstance(inner, Progress)
    inner.update(1, 4, unit="tok", detail="EV 0.65")
    assert seen[-1].fraction == pytest.approx(0.5 + 0.5 / 4) and "EV 0.65" in seen[-1].text()


def test_time_left_comes_from_the_measured_rate(monkeypatch):
    clock = iter([0.0, 10.0, 10.0])
    monkeypatch.setattr("slmviz.progress.time.perf_counter", lambda: next(clock))
    p, seen = collect()
    p.update(1, 4)
    assert seen[-1].eta_s == pytest.approx(30.0) and seen[-1].text().endswith("30s left")


def test_off_and_bad_progress_arguments():
    as_progress(None, "job").update(1, 2)  # reports nowhere
    as_progress(False, "job").update(1, 2)
    with pytest.raises(TypeError, match="progress must be"):
        as_progress(3, "job")


def test_a_sink_that_raises_stops_the_job_where_it_reports():
    def cancel(update):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        as_progress(cancel, "job").update(1, 2)


@pytest.mark.parametrize("s, text", [(4.4, "4s"), (190, "3m 10s"), (3900, "1h 05m")])
def test_times_read_as_a_person_reads_them(s, text):
    assert format_seconds(s) == text


def test_the_terminal_bar_is_one_bar_of_the_whole_job(capsys):
    p = as_progress(True, "prepare")
    p.part("a", 0.5).update(1, 1)
    p.part("b", 0.5).update(1, 2)
    assert p._root.sink.bar.n == 750


def test_every_library_function_takes_progress_as_the_one_contract():
    """Each long job's `progress` parameter is annotated ProgressLike (one contract; the issue found four aliases of
    different shapes), and no module defines a callback alias of its own."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "slmviz"
    wrong, aliases = [], []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            if isinstance(node, ast.Assign) and "Progress" in names:
                aliases.append(f"{path.relative_to(root)}:{node.lineno}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                for a in node.args.args + node.args.kwonlyargs:
                    if a.arg == "progress" and a.annotation is not None and ast.unparse(a.annotation) not in (
                            "ProgressLike", "Progress"):
                        wrong.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {ast.unparse(a.annotation)}")
    assert not aliases, aliases
    assert not wrong, wrong
