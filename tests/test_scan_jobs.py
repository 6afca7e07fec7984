"""The app's shared background jobs (app/jobs.py) and the corpus scans built on them (app/scans.py),
in process on the tiny model: a job runs once for every visitor, stops when the last one leaves, keeps going
while another still waits, and a stopped job starts again for the next visitor.

Does not cover: the same over HTTP and in the page (tests/test_corpus_app.py, tests/test_corpus_browser.py).
"""

from __future__ import annotations

import threading

import pytest
from app_helpers import REPO  # noqa: F401 - puts the repo on sys.path for `app`

from app import jobs as jobs_module
from app.jobs import Job, JobCancelled, Jobs, wait
from app.scans import CorpusScans, scan_folder, scan_hooks


def blocking_work(gate: threading.Event, reports: list[float]):
    """Work that reports progress every few ms until `gate` is set, then returns 42."""

    def work(report):
        i = 0
        while not gate.wait(0.005):
            i += 1
            reports.append(i)
            report(min(i / 1000, 0.99), f"step {i}")
        return 42

    return work


def test_a_job_runs_once_for_every_visitor_who_joins():
    jobs, gate, reports = Jobs(), threading.Event(), []
    first = jobs.join("k", blocking_work(gate, reports), "alice")
    second = jobs.join("k", blocking_work(gate, []), "bob")
    assert second is first
    gate.set()
    assert first.done.wait(5) and first.result == 42 and jobs.finished("k") == 42
    assert jobs.join("k", blocking_work(gate, []), "carol") is first  # finished: the same result, no new run


def test_a_job_stops_when_its_last_visitor_leaves_and_not_before():
    jobs, gate, reports = Jobs(), threading.Event(), []
    job = jobs.join("k", blocking_work(gate, reports), "alice")
    jobs.join("k", blocking_work(gate, []), "bob")
    jobs.leave("alice")
    assert not job.done.wait(0.2)  # bob still waits
    jobs.leave("bob")
    assert job.done.wait(5) and isinstance(job.error, JobCancelled)
    assert jobs.finished("k") is None
    gate.set()
    again = jobs.join("k", blocking_work(gate, []), "carol")  # a cancelled job starts again for the next visitor
    assert again is not job and again.done.wait(5) and again.result == 42


def test_a_watch_that_is_not_renewed_lapses(monkeypatch):
    monkeypatch.setattr(jobs_module, "ABANDONED_S", 0.05)
    job = Job("k", blocking_work(threading.Event(), []))
    job.watch("alice")
    job.start()
    assert job.done.wait(5) and isinstance(job.error, JobCancelled)  # alice never polled: a closed tab


def test_waiting_renews_the_watch_reports_progress_and_re_raises_errors(monkeypatch):
    monkeypatch.setattr(jobs_module, "ABANDONED_S", 0.3)
    monkeypatch.setattr(jobs_module, "POLL_S", 0.02)
    gate, seen = threading.Event(), []
    job = Jobs().join("k", blocking_work(gate, []), "alice")
    for ticks, _ in enumerate(wait(job, "alice", lambda fraction, desc: seen.append(desc)), start=1):
        if ticks == 30:  # 0.6 s of waiting: twice the lapse time, so only renewals kept the job alive
            gate.set()
    assert job.result == 42 and seen and seen[-1].startswith("step")

    def broken(report):
        raise ValueError("no such corpus")

    failed = Jobs().join("k", broken, "alice")
    with pytest.raises(ValueError, match="no such corpus"):
        list(wait(failed, "alice"))


def test_the_corpus_scan_is_computed_once_cached_on_disk_and_cancellable(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("SLMVIZ_SCAN_CACHE", str(tmp_path))
    monkeypatch.setenv("SLMVIZ_CORPUS_DOCS", "12")
    scans = CorpusScans()
    job = scans.tab_scan(tiny_model, "alice")
    list(wait(job, "alice"))
    s, docs = job.result
    assert len(docs) == 12 and s.info["documents"] == 12 and set(s.hooks) == set(scan_hooks(tiny_model))
    folder = scan_folder(tiny_model, 12, scan_hooks(tiny_model))
    assert (folder / "scan.safetensors").is_file()
    assert scans.finished(tiny_model, scan_hooks(tiny_model))[0] is s

    fresh = CorpusScans()  # a restarted server reads the cached scan instead of scanning again
    reread = fresh.tab_scan(tiny_model, "bob")
    list(wait(reread, "bob"))
    assert reread.result[0].info == s.info

    monkeypatch.setenv("SLMVIZ_CORPUS_DOCS", "3000")  # a long scan, left at once
    long = scans.tab_scan(tiny_model, "carol")
    scans.jobs.leave("carol")
    assert long.done.wait(60) and isinstance(long.error, JobCancelled)
    assert not scan_folder(tiny_model, 3000, scan_hooks(tiny_model)).exists()


def test_mean_ablation_means_come_from_the_tab_scan_or_a_scan_of_just_those_hooks(tiny_model, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setenv("SLMVIZ_SCAN_CACHE", str(tmp_path))
    monkeypatch.setenv("SLMVIZ_CORPUS_DOCS", "8")
    scans = CorpusScans()
    other = ["blocks.1.hook_resid_mid"]  # not a hook of the tab's scan (2 layers: it has both layers' z)
    assert other[0] not in scan_hooks(tiny_model)
    job = scans.means(tiny_model, other, "alice")
    list(wait(job, "alice"))
    assert job.result[0].hooks == other and scans.finished_means(tiny_model, other) is job.result
    tab = scans.tab_scan(tiny_model, "alice")
    list(wait(tab, "alice"))
    covered = [h for h in scan_hooks(tiny_model) if h.endswith("hook_z")][:1]
    assert scans.means(tiny_model, covered, "alice") is tab  # the tab's scan already has them
    assert scans.finished_means(tiny_model, covered) is tab.result


def test_a_visitor_who_left_stops_waiting_even_if_its_request_goes_on(monkeypatch):
    monkeypatch.setattr(jobs_module, "POLL_S", 0.02)
    jobs, gate = Jobs(), threading.Event()
    job = jobs.join("k", blocking_work(gate, []), "alice")
    jobs.join("k", blocking_work(gate, []), "bob")
    alice_waits = wait(job, "alice")
    next(alice_waits)
    jobs.leave("alice")  # Cancel over the API: Gradio does not stop alice's request, her wait must end itself
    with pytest.raises(JobCancelled):
        list(alice_waits)
    assert not job.done.is_set()  # bob still waits
    jobs.join("k", blocking_work(gate, []), "alice")  # alice presses Load again: she waits once more
    assert job.renew("alice")
    gate.set()
    assert job.done.wait(5) and job.result == 42


def test_long_jobs_run_one_at_a_time_first_asked_first_run_and_a_queued_one_says_its_place():
    jobs, gate, order = Jobs(), threading.Event(), []

    def recorded(name):
        def work(report):
            order.append(name)
            report(0.5, f"{name} half way", partial=[name])
            return name
        return work

    first = jobs.submit(blocking_work(gate, []), "alice", kind="patch")
    second = jobs.submit(recorded("second"), "bob")
    third = jobs.join("scan", recorded("third"), "carol", kind="scan")
    assert not second.done.wait(0.2) and order == []  # the first job holds the one worker
    assert second.desc == "waiting for 1 long job ahead of it (one runs at a time)"
    assert third.desc == "waiting for 2 long jobs ahead of it (one runs at a time)"
    gate.set()
    assert third.done.wait(5) and order == ["second", "third"]
    assert (first.result, second.result, third.result) == (42, "second", "third")
    assert second.partial == ["second"]  # what the work published as it went
    assert jobs.finished("scan") == "third"  # a shared job is kept; one-off jobs are not
    assert all(key == "scan" for key in jobs._jobs)


def test_a_queued_job_whose_visitor_left_never_starts_and_the_cancel_of_one_kind_spares_the_others():
    jobs, gate, ran = Jobs(), threading.Event(), []
    running = jobs.submit(blocking_work(gate, []), "alice", kind="scan")
    queued = jobs.submit(lambda report: ran.append(1), "alice", kind="patch")
    jobs.leave("alice", kind="patch")
    assert not running.done.wait(0.2)  # alice's scan goes on
    gate.set()
    assert queued.done.wait(5) and isinstance(queued.error, JobCancelled) and ran == []
    assert running.done.wait(5) and running.result == 42


def test_closing_a_wait_leaves_the_job_at_once(monkeypatch):
    """Gradio's Cancel stops iterating the waiting handler and closes it: the job must stop, not wait for the
    watch to lapse."""
    monkeypatch.setattr(jobs_module, "POLL_S", 0.02)
    jobs, gate = Jobs(), threading.Event()
    job = jobs.submit(blocking_work(gate, []), "alice")
    waiting = wait(job, "alice")
    next(waiting)
    waiting.close()
    assert job.done.wait(5) and isinstance(job.error, JobCancelled)


def test_a_result_put_under_a_key_is_joined_and_finished_without_running():
    """Jobs.put: a scan prepared elsewhere (a full transcoder set's) is served as a finished shared job."""
    jobs = Jobs()
    put = jobs.put("prepared", ("scan", ["doc"]), kind="scan")
    assert jobs.finished("prepared") == ("scan", ["doc"])
    joined = jobs.join("prepared", lambda report: pytest.fail("a put result is never computed"), "alice", kind="scan")
    assert joined is put and joined.done.is_set() and list(wait(joined, "alice")) == []
