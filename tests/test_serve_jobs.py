"""Asynchronous video jobs (serve/jobs.py): the store (serve/jobstore.py: a SQLite file, and a PostgreSQL server of
the test's own where Debian's package is installed) and its restart rules in-process with the real scheduler; then
OpenAI's own client against a tiny Wan server at tp2, restarted at tp2 x ulysses2 after SIGTERM and at one rank after
kill -9, two servers sharing a PostgreSQL store, and the web page in a real headless browser."""

from __future__ import annotations

import io
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select

from paradiff.serve.jobs import Jobs, form_fields, keep_results, video_object
from paradiff.serve.jobstore import OWNERS, JobStore, StoreError, store_url
from paradiff.serve.protocol import Limits, RequestError
from paradiff.serve.scheduler import Scheduler
from paradiff_testkit.browser import CHROMIUM, launch_chromium

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the client's, on every call

LIMITS = Limits(kind="video", model_name="wan", default_size=(32, 32), default_frames=5, max_frames=10,
                accepts=frozenset({"num_frames"}))


def _files(tag: bytes) -> dict:
    return {"files": [{"mime": "video/mp4", "data": b"mp4" + tag}, {"mime": "image/png", "data": b"png" + tag}],
            "replica": 0, "started": 0.0, "finished": 0.0}


def test_job_store_keeps_jobs_across_restarts_and_expires_results_by_count(store):
    """In-process, the real scheduler standing in for the ranks, on a SQLite file (WAL) and on PostgreSQL: a job runs,
    completes and is downloadable; at a drain the waiting jobs leave the scheduler and stay queued; a reopened store
    fails the job that was running when the process died (server_restarted) and submits the queued ones again;
    --keep-results 2 expires the oldest result (listed, content 410); pages in both orders; a deleted id says so."""
    db = store
    scheduler = Scheduler(max_queue=8)
    jobs = Jobs(JobStore(db), keep_results("2"), scheduler)
    if "://" not in store:
        assert jobs.store.journal_mode() == "wal" and jobs.store.url == "sqlite:///" + str(Path(db).resolve())
    else:
        assert jobs.store.journal_mode() is None and jobs.store.url.startswith("postgresql+psycopg://")
    jobs.ready(LIMITS)
    first = jobs.create({"prompt": "a fox", "seed": 3, "steps": 2}, LIMITS, max_queue=8)
    assert video_object(first)["status"] == "queued" and first["progress"] == 0
    second = jobs.create({"prompt": "a cat", "seconds": 1, "fps": 4}, LIMITS, max_queue=8)
    assert second["params"]["frames"] == 5 and second["seconds"] == "1.25"  # seconds * fps + 1 frames
    third = jobs.create({"prompt": "a dog"}, LIMITS, max_queue=8)
    round_ = scheduler.next_round(1, 0)
    (item,) = round_["batches"][0]
    jobs.started([item["id"]])
    scheduler.running(item["id"]).emit({"type": "step", "step": 1, "steps": 2, "done": 1, "total": 2})  # its progress
    assert jobs.known(first["id"])["status"] == "in_progress" and jobs.known(first["id"])["progress"] == 50
    scheduler.complete(item["id"], 200, _files(b"1"))
    done = jobs.known(first["id"])
    assert done["status"] == "completed" and done["progress"] == 100
    assert jobs.content(first["id"], "thumbnail") == (b"png1", "image/png")
    assert [(file["variant"], file["bytes"]) for file in done["files"]] == [("video", 4), ("thumbnail", 4)]
    round_ = scheduler.next_round(1, 0)  # the second job runs; the third waits
    jobs.started([round_["batches"][0][0]["id"]])
    jobs.hold()  # SIGTERM: the third leaves the scheduler, still queued
    assert scheduler.depth() == (0, 1) and jobs.known(third["id"])["status"] == "queued"
    jobs.store.close()  # killed here, the second job still running

    scheduler = Scheduler(max_queue=8)
    jobs = Jobs(JobStore(db), keep_results("2"), scheduler)
    assert jobs.interrupted == [second["id"]]
    failed = video_object(jobs.known(second["id"]))
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_restarted"
    jobs.ready(LIMITS)
    (item,) = scheduler.next_round(1, 0)["batches"][0]
    assert item["prompt"] == "a dog"
    jobs.started([item["id"]])
    scheduler.complete(item["id"], 200, _files(b"3"))
    fourth = jobs.create({"prompt": "a bird"}, LIMITS, max_queue=8)
    (item,) = scheduler.next_round(1, 0)["batches"][0]
    scheduler.complete(item["id"], 200, _files(b"4"))
    with pytest.raises(RequestError) as expired:  # three results, --keep-results 2: the oldest went
        jobs.content(first["id"], "video")
    assert expired.value.status == 410 and "expired" in str(expired.value)
    assert jobs.store.result(first["id"], "video") is None and jobs.known(first["id"])["expires_at"] is not None
    page, more = jobs.store.page(None, 2, "desc")
    assert [job["id"] for job in page] == [fourth["id"], third["id"]] and more
    page, more = jobs.store.page(third["id"], 2, "desc")
    assert [job["id"] for job in page] == [second["id"], first["id"]] and not more
    page, more = jobs.store.page(first["id"], 2, "asc")
    assert [job["id"] for job in page] == [second["id"], third["id"]] and more
    assert jobs.delete(fourth["id"]) and jobs.store.result(fourth["id"], "video") is None  # its files went
    with pytest.raises(RequestError, match="was deleted"):
        jobs.known(fourth["id"])
    waiting = jobs.create({"prompt": "a hare"}, LIMITS, max_queue=8)
    assert scheduler.depth() == (1, 0)
    assert jobs.delete(waiting["id"]) and scheduler.depth() == (0, 0)  # a queued job leaves the queue
    assert not jobs.delete(waiting["id"]) and jobs.store.get(waiting["id"])["status"] == "queued"  # as it was
    with pytest.raises(RequestError, match="no video 'video_x'"):
        jobs.known("video_x")
    with pytest.raises(RequestError, match="queue is full"):
        jobs.hold()
        for _ in range(3):
            jobs.create({"prompt": "x"}, LIMITS, max_queue=2)
    with pytest.raises(RequestError, match="n: a video job makes one video"):
        jobs.create({"prompt": "x", "n": 2}, LIMITS, max_queue=8)
    jobs.store.close()


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server of this module's own (its new_database() makes an empty database on it: the URL)."""
    from paradiff_testkit.postgres import binaries, postgres_server

    if binaries() is None:
        pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql; .ci/run installs it)")
    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path) -> str:
    """Where a test's servers keep their jobs: a SQLite file, or a database of the module's PostgreSQL server."""
    if request.param == "sqlite":
        return str(tmp_path / "jobs.db")
    return request.getfixturevalue("postgres").new_database()


def test_servers_sharing_one_store_run_each_job_once_and_take_over_a_dead_ones(store):
    """Two servers on one job store (the meshes of `paradiff serve --ray`), in-process with the real scheduler, on a
    SQLite file and on PostgreSQL: a job runs on the one that claimed it and never on both; either answers any job
    and its content; a job deleted through the other is cancelled at its next step, or as its round starts; when
    one dies (its store closed: its owner row goes with it), the other fails the job it was running
    (server_restarted) and runs the one it had claimed; one that drains releases its waiting jobs to the others."""
    schedulers = [Scheduler(max_queue=8), Scheduler(max_queue=8)]
    a, b = (Jobs(JobStore(store), keep_results("10"), scheduler) for scheduler in schedulers)
    a.ready(LIMITS)
    b.ready(LIMITS)
    first = a.create({"prompt": "a fox", "seed": 1}, LIMITS, max_queue=8)  # claimed by a as it is queued
    b.feed()
    second = b.create({"prompt": "a cat", "seed": 2}, LIMITS, max_queue=8)
    a.feed()
    assert [scheduler.depth() for scheduler in schedulers] == [(1, 0), (1, 0)]  # one each, none twice
    assert (a.store.get(first["id"])["owner"], a.store.get(second["id"])["owner"]) == (a.store.owner, b.store.owner)
    (item,) = schedulers[0].next_round(1, 0)["batches"][0]
    a.started([item["id"]])
    schedulers[0].complete(item["id"], 200, _files(b"1"))
    assert b.known(first["id"])["status"] == "completed"
    assert b.content(first["id"], "video") == (b"mp41", "video/mp4")
    (item,) = schedulers[1].next_round(1, 0)["batches"][0]
    b.started([item["id"]])
    running = schedulers[1].running(item["id"])
    assert a.delete(second["id"])  # through a: b's job runs on
    assert not running.done.is_set()
    running.emit({"type": "step", "step": 1, "steps": 2, "done": 1, "total": 2})
    assert running.done.wait(timeout=60) and running.status == 499  # cancelled at the step
    assert schedulers[1].answered_running() == [item["id"]]  # rank 0 is told to stop its work
    waiting = b.create({"prompt": "a bee", "seed": 5}, LIMITS, max_queue=8)  # claimed by b, deleted through a
    assert a.delete(waiting["id"])  # before its round: cancelled as the round starts
    (item,) = schedulers[1].next_round(1, 0)["batches"][0]
    b.started([item["id"]])
    assert schedulers[1].running(item["id"]).status == 499
    third = a.create({"prompt": "a dog", "seed": 3}, LIMITS, max_queue=8)
    fourth = a.create({"prompt": "a hare", "seed": 4}, LIMITS, max_queue=8)
    (item,) = schedulers[0].next_round(1, 0)["batches"][0]
    a.started([item["id"]])
    assert b.store.alive(a.store.owner)
    a.store.close()  # a's process died: the third was running there, the fourth claimed
    assert not b.store.alive(a.store.owner)
    b.feed()
    failed = video_object(b.known(third["id"]))
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_restarted"
    assert b.store.get(fourth["id"])["owner"] == b.store.owner and schedulers[1].depth()[0] == 1
    (item,) = schedulers[1].next_round(1, 0)["batches"][0]
    assert item["prompt"] == "a hare"
    c = Jobs(JobStore(store), keep_results("10"), Scheduler(max_queue=8))
    c.ready(LIMITS)
    held = c.create({"prompt": "an owl", "seed": 6}, LIMITS, max_queue=8)
    assert c.store.get(held["id"])["owner"] == c.store.owner
    c.hold()  # c drains: its waiting job is released, for the servers that go on
    b.feed()
    assert b.store.get(held["id"])["owner"] == b.store.owner
    b.store.close()
    c.store.close()


def test_an_owner_on_another_machine_is_dead_once_its_counter_stands_still_for_the_lease(store):
    """Owners on other machines (another `host`) are judged by their counter alone, on the observer's own clock (a
    clock of the test's: no sleeps): alive while it moves, dead once it stood still for the lease, and then their
    running job fails and their claimed one is released; the beating thread raises the counter by itself."""
    now = [0.0]
    a = JobStore(store, beat_s=None, host="node-a")
    b = JobStore(store, beat_s=None, host="node-b", lease_s=20, clock=lambda: now[0])
    running = a.add("video", "wan", {"prompt": "a fox"}, "32x32", "1", claimed=True)
    a.started(running["id"])
    claimed = a.add("video", "wan", {"prompt": "a cat"}, "32x32", "1", claimed=True)
    assert b.alive(a.owner)  # first seen
    now[0] = 19.5
    assert b.alive(a.owner) and b.orphans("gone") == []
    a.beat()
    now[0] = 39.0
    assert b.alive(a.owner)  # it moved: seen at 39
    now[0] = 58.5
    assert b.alive(a.owner)
    now[0] = 59.5
    assert not b.alive(a.owner) and a.owner not in b.owners()  # still for 20.5 s: dead, its row gone
    assert b.orphans("gone") == [running["id"]] and b.get(running["id"])["error"]["code"] == "server_restarted"
    assert b.get(claimed["id"])["owner"] is None and b.claim(claimed["id"])
    beating = JobStore(store, beat_s=0.01)
    deadline = time.monotonic() + 60
    while _beats(b, beating.owner) < 2:
        assert time.monotonic() < deadline, "the owner's counter did not rise"
        time.sleep(0.01)
    for store_ in (a, b, beating):
        store_.close()


def test_a_database_server_restart_fails_no_job_and_stops_no_server(postgres, capsys):
    """The PostgreSQL server stops while a job runs: the HTTP side's calls answer 503 naming the store (not 500), rank
    0's side says so once, writes no progress and keeps the finished job's result; once the server is back, the
    result is written (the job completed, its content there) and the store's own connection opened again."""
    scheduler = Scheduler(max_queue=8)
    jobs = Jobs(JobStore(postgres.new_database(), beat_s=None), keep_results("10"), scheduler)
    jobs.ready(LIMITS)
    job = jobs.create({"prompt": "a fox", "seed": 1}, LIMITS, max_queue=8)
    (item,) = scheduler.next_round(1, 0)["batches"][0]
    jobs.started([item["id"]])
    running = scheduler.running(item["id"])
    running.emit({"type": "step", "step": 1, "steps": 4, "done": 1, "total": 4})
    postgres.stop()
    try:
        with pytest.raises(StoreError) as away:
            jobs.known(job["id"])
        assert away.value.status == 503 and "cannot be reached" in str(away.value) and away.value.retry_after
        running.emit({"type": "step", "step": 2, "steps": 4, "done": 2, "total": 4})
        scheduler.complete(item["id"], 200, _files(b"1"))  # its result waits in the server
        jobs.feed()
        assert not running.status == 499  # not cancelled for want of the store
        assert jobs.store_state() == (False, 1)  # /metrics: paradiff_job_store_up 0, paradiff_job_results_waiting 1
    finally:
        postgres.start()
    said = capsys.readouterr().err
    assert said.count("cannot be reached") == 1 and "image requests go on" in said, said
    jobs.feed()  # the dispatcher's next look
    done = jobs.known(job["id"])
    assert (done["status"], done["progress"]) == ("completed", 100)
    assert jobs.content(job["id"], "video") == (b"mp41", "video/mp4")
    other = JobStore(jobs.store.url, beat_s=None)  # committed: another connection sees it
    assert other.get(job["id"])["status"] == "completed" and other.claim(job["id"]) is False
    beats = _beats(other, jobs.store.owner)
    jobs.store.beat()  # a write on the store's own connection, opened again in autocommit: committed
    assert _beats(other, jobs.store.owner) == beats + 1
    other.close()
    assert capsys.readouterr().err.count("answers again") == 1 and jobs.store_state() == (True, 0)
    jobs.store.close()


def test_a_server_cut_off_from_the_database_starts_none_of_its_claimed_jobs(postgres):
    """A server whose counter has not risen for half the lease (the database away from it) withdraws the claimed jobs
    waiting in its scheduler before the others may count it dead and run them (so no job runs twice); its running
    job runs on. When the database answers again, they are submitted here again; an owner the others found dead in
    the meantime writes its row again."""
    now = [0.0]
    scheduler = Scheduler(max_queue=8)
    jobs = Jobs(JobStore(postgres.new_database(), beat_s=None, lease_s=20, clock=lambda: now[0]), keep_results("10"),
                scheduler)
    jobs.ready(LIMITS)
    running, waiting = (jobs.create({"prompt": p}, LIMITS, max_queue=8) for p in ("a fox", "a cat"))
    (item,) = scheduler.next_round(1, 0)["batches"][0]
    jobs.started([item["id"]])
    assert scheduler.depth() == (1, 1)
    postgres.stop()
    try:
        now[0] = 9.0
        jobs.feed()
        assert scheduler.depth() == (1, 1)  # within half the lease: it stays
        now[0] = 10.5
        jobs.feed()
        assert scheduler.depth() == (0, 1) and not scheduler.running(item["id"]).done.is_set()
    finally:
        postgres.start()
    jobs.store.beat()
    jobs.feed()
    assert scheduler.depth() == (1, 1) and jobs.store.get(waiting["id"])["owner"] == jobs.store.owner
    other = JobStore(jobs.store.url, beat_s=None)
    with other.engine.begin() as connection:  # as another machine's owner does when it counts this one dead
        connection.exec_driver_sql("SET LOCAL lock_timeout = '10s'")  # a row left locked fails, not hangs
        connection.execute(OWNERS.delete().where(OWNERS.c.owner == jobs.store.owner))
    jobs.store.beat()
    assert jobs.store.owner in other.owners()
    other.close()
    jobs.store.close()


def test_an_owner_killed_on_this_machine_is_dead_at_once(tmp_path, store):
    """An owner's process killed with kill -9 (and not yet reaped: a zombie) is dead at once for an owner on the same
    machine: its running job fails, its claimed one goes back to the queue."""
    b = JobStore(store, beat_s=None)
    child = subprocess.Popen([sys.executable, "-c", CHILD, store], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    running, claimed, owner = child.stdout.readline().split()  # its jobs are in the store
    assert b.alive(owner)
    child.kill()
    deadline = time.monotonic() + 60
    while Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1][0] != "Z":  # the kill landed; not reaped
        assert time.monotonic() < deadline, "the child did not die"
        time.sleep(0.01)
    assert not b.alive(owner)
    assert b.orphans("gone") == [running] and b.get(claimed)["owner"] is None
    child.wait()
    b.close()


def _beats(store_: JobStore, owner: str) -> int:
    with store_.engine.connect() as connection:
        return connection.execute(select(OWNERS.c.beat).where(OWNERS.c.owner == owner)).scalar()


CHILD = """
import sys, time
from paradiff.serve.jobstore import JobStore
store = JobStore(sys.argv[1])
running = store.add("video", "wan", {"prompt": "a fox"}, "32x32", "1", claimed=True)["id"]
store.started(running)
claimed = store.add("video", "wan", {"prompt": "a cat"}, "32x32", "1", claimed=True)["id"]
print(running, claimed, store.owner, flush=True)
time.sleep(600)
"""


def test_a_store_of_the_earlier_layout_moves_its_result_files_into_the_database(tmp_path):
    """A SQLite store written before results were kept in it (files under jobs/<id>/ beside it, their paths in the
    job's `files`): opened, its results are in the database, their folders gone; a job whose files were gone has
    none (its content answers as before: 404, or 410 once expired)."""
    db = tmp_path / "jobs.db"
    store = JobStore(db, beat_s=None)
    kept, lost = (store.add("video", "wan", {"prompt": p}, "32x32", "1")["id"] for p in ("a fox", "a cat"))
    store.close()
    with sqlite3.connect(db) as connection:
        for job_id in (kept, lost):
            files = [{"variant": "video", "path": f"{job_id}/video.mp4", "mime": "video/mp4"},
                     {"variant": "thumbnail", "path": f"{job_id}/thumbnail.png", "mime": "image/png"}]
            connection.execute("UPDATE jobs SET status = 'completed', files = ? WHERE id = ?",
                               (json.dumps(files), job_id))
    (tmp_path / "jobs" / kept).mkdir(parents=True)
    (tmp_path / "jobs" / kept / "video.mp4").write_bytes(b"mp4 of old")
    (tmp_path / "jobs" / kept / "thumbnail.png").write_bytes(b"png of old")
    store = JobStore(db, beat_s=None)
    assert store.result(kept, "video") == (b"mp4 of old", "video/mp4")
    assert store.result(kept, "thumbnail") == (b"png of old", "image/png")
    assert store.get(kept)["files"] == [{"variant": "video", "mime": "video/mp4", "bytes": 10},
                                        {"variant": "thumbnail", "mime": "image/png", "bytes": 10}]
    assert store.result(lost, "video") is None and store.get(lost)["files"] == []
    assert not (tmp_path / "jobs").exists()
    store.close()


def test_store_urls_and_byte_ranges():
    """--jobs-db: a path is a SQLite file's absolute URL, libpq's postgresql:// goes through psycopg 3, another
    database is refused by name (without printing a password); a result's bytes answer a browser's Range header."""
    from paradiff.serve.app import byte_range
    from paradiff.serve.jobstore import shown

    assert store_url("out/jobs.db") == "sqlite:///" + str(Path("out/jobs.db").resolve())
    assert store_url("postgresql://u:pw@db.example:5432/jobs") == "postgresql+psycopg://u:pw@db.example:5432/jobs"
    assert store_url("postgres://u@db/jobs") == "postgresql+psycopg://u@db/jobs"
    for where in ("out/jobs.db", "postgresql://u:pw@db/jobs"):  # as --ray hands it to its meshes, read again by each
        assert store_url(store_url(where)) == store_url(where)
    assert shown("postgresql://u:secret@db/jobs") == "postgresql://u:***@db/jobs"
    with pytest.raises(ValueError, match="mysql databases are not supported") as refused:
        store_url("mysql://u:secret@db/jobs")
    assert "secret" not in str(refused.value)
    data = bytes(range(10))
    whole = byte_range(data, "video/mp4", None)
    assert (whole.status_code, whole.body, whole.headers["accept-ranges"]) == (200, data, "bytes")
    part = byte_range(data, "video/mp4", "bytes=2-4")
    assert (part.status_code, part.body, part.headers["content-range"]) == (206, data[2:5], "bytes 2-4/10")
    assert byte_range(data, "video/mp4", "bytes=7-").body == data[7:]
    assert byte_range(data, "video/mp4", "bytes=-3").body == data[7:]
    assert byte_range(data, "video/mp4", "bytes=5-99").headers["content-range"] == "bytes 5-9/10"
    outside = byte_range(data, "video/mp4", "bytes=10-")
    assert (outside.status_code, outside.headers["content-range"]) == (416, "bytes */10")
    assert byte_range(data, "video/mp4", "bytes=0-1,4-5").status_code == 200  # several: the whole file


def test_a_job_store_that_cannot_be_opened_is_refused_in_one_line(capsys, tmp_path):
    """`paradiff serve --jobs-db` that names another database, a server that does not answer, or a file that cannot
    be written: one line naming the flag (never the password), before any rank starts."""
    from paradiff.cli import main

    (tmp_path / "file").write_text("")
    for where, said in [("mysql://u:secret@db/jobs", "mysql databases are not supported"),
                        ("postgresql://u:secret@127.0.0.1:1/jobs", "cannot open the job store (connection"),
                        (str(tmp_path / "file" / "jobs.db"), "cannot open the job store")]:
        assert main(["serve", "--jobs-db", where, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert said in err and "--jobs-db" in err and "secret" not in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_forms_and_retention_flags_are_read_as_documented():
    assert form_fields([("prompt", "a fox"), ("seed", "3"), ("guidance", "4.5"), ("loras[style]", "0.5"),
                        ("size", "32x32")]) == {"prompt": "a fox", "seed": 3, "guidance": 4.5,
                                                "loras": {"style": 0.5}, "size": "32x32"}
    with pytest.raises(RequestError, match="steps: expected a number, got 'many'"):
        form_fields([("steps", "many")])
    assert keep_results("100") == ("count", 100) and keep_results("12h") == ("age", 43200)
    with pytest.raises(ValueError, match="--keep-results '0'"):
        keep_results("0")
    with pytest.raises(ValueError, match="--keep-results 'a week'"):
        keep_results("a week")


# -- a real server ---------------------------------------------------------------------------------------------------
VIDEO = ["--frames", "5", "--steps", "2", "--height", "32", "--width", "32", "--fps", "8", "--max-steps", "1000"]


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def _wait(what, condition, timeout_s: float = 120):
    """Poll `condition()` (bounded) until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.02)


def assert_first_frame(png: bytes, frames: np.ndarray) -> None:
    """`png` is the first of `frames` up to rounding (a split run sums in another order: tests/test_serve.py)."""
    difference = np.abs(_pixels(png) - frames[0])
    assert difference.max() <= 1 and (difference > 0).mean() <= 0.005, (difference.max(), (difference > 0).sum())


def assert_video(mp4: bytes, wan: dict, name: str) -> None:
    """`mp4` is the H.264 of the 5 frames of 'a fox', seed 3, at 8 fps (lossy: compared by mean luma)."""
    import av

    path = wan["root"] / name
    path.write_bytes(mp4)
    with av.open(str(path)) as container:
        assert container.streams.video[0].average_rate == 8
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
    assert frames.shape == (5, 32, 32, 3)
    luma = np.array([0.299, 0.587, 0.114])
    assert np.abs(frames @ luma - wan["frames"].astype(np.float64) @ luma).mean() < 8  # lossy H.264 of those


def _status(client, video_id: str) -> str:
    return client.videos.retrieve(video_id).status


def _states(db: Path) -> dict[str, str]:
    with sqlite3.connect(db) as connection:
        return dict(connection.execute("SELECT id, status FROM jobs WHERE deleted_at IS NULL"))


def _owners(db: Path) -> list[str]:
    with sqlite3.connect(db) as connection:
        return sorted(row[0] for row in connection.execute("SELECT owner FROM job_owners"))


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> dict:
    """A tiny Wan 2.2 pipeline folder and its frames for 'a fox', seed 3, from diffusers' own pipeline in this process
    (the frames `paradiff generate` writes for that seed, value for value: checked once when this test was written;
    a subprocess of `generate` would cost this file most of its time)."""
    import torch
    from diffusers import DiffusionPipeline

    from paradiff.io.outputs import png_bytes
    from paradiff_testkit.pipelines import save_pipeline

    root = tmp_path_factory.mktemp("wan-jobs")
    folder = save_pipeline("wan2.2", root / "wan2.2")
    pipeline = DiffusionPipeline.from_pretrained(str(folder))
    pipeline.set_progress_bar_config(disable=True)
    video = pipeline(prompt="a fox", generator=torch.Generator("cpu").manual_seed(3), height=32, width=32,
                     num_frames=5, num_inference_steps=2, output_type="np").frames[0]
    frames = np.stack([_pixels(png_bytes(frame)) for frame in video])  # 8-bit, as generate's PNG files
    return {"folder": str(folder), "frames": frames, "root": root}


@pytest.fixture(scope="module")
def history(wan, tmp_path_factory):
    """The jobs' life over three starts of one server folder, driven by OpenAI's client; yields the last server
    (still running, for the page) and what was seen."""
    import openai

    from paradiff_testkit.serve import ServerProcess

    seen: dict = {}
    root = tmp_path_factory.mktemp("jobs-server")
    out = root / "serve"

    began = time.monotonic()

    def start(*flags: str) -> tuple[ServerProcess, "openai.OpenAI"]:
        print(f"\n{time.monotonic() - began:.1f} s: start {flags}")
        for attempt in range(3):
            server = ServerProcess(root, wan["folder"], *VIDEO, *flags)
            try:
                server.wait_ready()
                break
            except AssertionError:
                # the free port was taken between its choice and the bind (by another process of a loaded
                # machine): seen in the console, then another port; any other failure stands
                if attempt == 2 or "address already in use" not in server.text():
                    raise
                server.stop()
        print(f"{time.monotonic() - began:.1f} s: ready")
        return server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

    # 1. tp2: create, follow, list, delete a running job, download; then SIGTERM with one job running, two queued
    server, client = start("--tp", "2")
    try:
        long = client.videos.create(model="wan2.2", prompt="a long fox", size="32x32", extra_body={"steps": 300})
        fox = client.videos.create(prompt="a fox", size="32x32", extra_body={"seed": 3})
        seen["created"] = (long, fox)
        rising = [_wait("long in progress", lambda: (v := client.videos.retrieve(long.id)).status == "in_progress"
                        and v.progress >= 1 and v)]
        seen["fox while long runs"] = _status(client, fox.id)  # one replica, busy: the fox waits
        rising.append(_wait("progress rising", lambda: (v := client.videos.retrieve(long.id)).progress
                            > rising[0].progress and v))
        seen["rising"] = rising
        seen["first page"] = client.videos.list(limit=1)
        seen["all pages"] = [video.id for video in client.videos.list(limit=1, order="asc")]
        seen["deleted"] = client.videos.delete(long.id)
        server.wait_for(lambda m: m["paradiff_requests_cancelled_total"] == 1)
        seen["cancelled steps"] = server.metrics()["paradiff_cancelled_steps_total"]
        with pytest.raises(openai.NotFoundError) as gone:
            client.videos.retrieve(long.id)
        seen["deleted retrieve"] = str(gone.value)
        seen["fox"] = _wait("fox completed", lambda: (v := client.videos.retrieve(fox.id)).status == "completed" and v)
        seen["mp4"] = client.videos.download_content(fox.id).read()
        seen["thumbnail"] = client.videos.download_content(fox.id, variant="thumbnail").read()
        with pytest.raises(openai.BadRequestError) as sheet:
            client.videos.download_content(fox.id, variant="spritesheet")
        seen["spritesheet"] = str(sheet.value)
        with pytest.raises(openai.NotFoundError) as unknown:
            client.videos.retrieve("video_unknown")
        seen["unknown"] = str(unknown.value)
        running = client.videos.create(prompt="a fox", size="32x32", extra_body={"seed": 4, "steps": 12})
        queued = [client.videos.create(prompt="a fox", size="32x32", extra_body={"seed": 3}) for _ in range(2)]
        _wait("running", lambda: _status(client, running.id) == "in_progress")
        seen["sigterm"] = (running.id, [video.id for video in queued])
        seen["sigterm exit"] = server.stop()
        seen["after sigterm"] = _states(out / "jobs.db")
    finally:
        server.stop()

    # 2. the restart, at tp2 x ulysses2 now (4 ranks: the store does not care), runs the queued jobs; a job runs
    # when the server is killed (kill -9, every process)
    server, client = start("--tp", "2", "--ulysses", "2")
    try:
        for video_id in seen["sigterm"][1]:
            _wait("queued job completed", lambda: _status(client, video_id) == "completed")
        seen["restart ready"] = server.text()  # its ready line, printed by now
        seen["after restart"] = {video_id: _status(client, video_id) for video_id in [seen["sigterm"][0],
                                                                                       *seen["sigterm"][1]]}
        seen["restart thumbnail"] = client.videos.download_content(seen["sigterm"][1][0], variant="thumbnail").read()
        seen["restart mp4"] = client.videos.download_content(seen["sigterm"][1][0]).read()
        killed = client.videos.create(prompt="a fox", size="32x32", extra_body={"steps": 1000})
        waiting = client.videos.create(prompt="a fox", size="32x32", extra_body={"seed": 5})
        _wait("killed job running", lambda: _status(client, killed.id) == "in_progress")
        seen["killed"] = (killed.id, waiting.id)
    finally:
        server.process.kill()
        server.client.close()

    # 3. after kill -9: the running job failed (server_restarted), the waiting one runs; --keep-results 2
    server, client = start("--keep-results", "2")
    try:
        _wait("waiting job completed", lambda: _status(client, seen["killed"][1]) == "completed")
        seen["after kill"] = {video.id: video for video in client.videos.list(limit=100)}
        with pytest.raises(openai.APIStatusError) as expired:
            client.videos.download_content(fox.id)
        seen["expired"] = expired.value
        seen["image request"] = server.generate(prompt="a fox")
        with pytest.raises(openai.BadRequestError) as frames:
            client.videos.create(prompt="a fox", extra_body={"frames": 0})
        seen["frames 0"] = str(frames.value)
        seen["paths"] = server.client.get("/openapi.json").json()["paths"]
        # 4. a second server on the same store (as `paradiff serve --ray` runs its meshes): it answers the first's
        # jobs and their content, and the first answers the job it ran
        (root / "other").mkdir()
        other = ServerProcess(root / "other", wan["folder"], *VIDEO, "--jobs-db", str(out / "jobs.db"))
        try:
            other.wait_ready()
            other_client = openai.OpenAI(base_url=other.url + "/v1", api_key="unused", max_retries=0)
            waited = seen["killed"][1]
            seen["shared"] = {"status": _status(other_client, waited),
                              "content": other_client.videos.download_content(waited).read(),
                              "own content": client.videos.download_content(waited).read()}
            made = other_client.videos.create(prompt="a fox", size="32x32", extra_body={"seed": 3})
            _wait("the other's job completed", lambda: _status(client, made.id) == "completed")
            seen["shared"]["ran on"] = sqlite3.connect(out / "jobs.db").execute(
                "SELECT owner FROM jobs WHERE id = ?", (made.id,)).fetchone()[0]
            seen["shared"]["owners"] = _owners(out / "jobs.db")
            seen["shared"]["made mp4"] = client.videos.download_content(made.id).read()
        finally:
            other.stop()
        seen["shared"]["owners after"] = _owners(out / "jobs.db")
        seen["server"] = server
        yield seen
    finally:
        server.stop()


@pytest.mark.slow
def test_servers_on_two_machines_share_jobs_through_postgresql(wan, postgres, tmp_path):
    """Two real servers with folders of their own (as on two machines: nothing on disk shared) on one PostgreSQL
    database: a job created through one runs there and is answered by the other, its MP4 (the frames diffusers
    draws for its seed) downloaded through the other, whole and as a byte range (a browser's video player seeks so);
    while the database server restarts, the job calls answer 503 with Retry-After and the servers stay up."""
    import openai

    from paradiff_testkit.serve import ServerProcess

    url = postgres.new_database()
    servers = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        servers.append(ServerProcess(tmp_path / name, wan["folder"], *VIDEO, "--jobs-db", url))
    try:
        for server in servers:
            server.wait_ready()
        a, b = (openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) for server in servers)
        made = a.videos.create(prompt="a fox", size="32x32", extra_body={"seed": 3})
        _wait("the job completed", lambda: _status(b, made.id) == "completed")
        mp4 = b.videos.download_content(made.id).read()
        assert_video(mp4, wan, "answered by the other server")
        assert a.videos.download_content(made.id).read() == mp4
        part = servers[1].client.get(f"/v1/videos/{made.id}/content", headers={"Range": "bytes=10-99"})
        assert (part.status_code, part.content, part.headers["content-range"]) == (206, mp4[10:100],
                                                                                   f"bytes 10-99/{len(mp4)}")
        assert [video.id for video in b.videos.list()] == [made.id]
        assert not any((tmp_path / name / "serve" / "jobs.db").exists() for name in ("a", "b"))
        postgres.stop()  # the database server restarts: the job calls answer 503, the server stays up
        try:
            away = servers[1].client.get(f"/v1/videos/{made.id}")
            assert (away.status_code, away.headers.get("retry-after")) == (503, "5"), away.text
            assert away.json()["error"]["code"] == "store_unavailable" and "cannot be reached" in away.text
            assert url.rsplit("/", 1)[1] not in away.text and "connection" not in away.text  # no internals
            assert servers[1].client.get("/health").status_code == 200
            servers[1].wait_for(lambda m: m["paradiff_job_store_up"] == 0)  # its dispatcher's next look, within 1 s
        finally:
            postgres.start()
        servers[1].wait_for(lambda m: m["paradiff_job_store_up"] == 1)
        assert _status(b, made.id) == "completed"  # its connection opened again
    finally:
        for server in servers:
            server.stop()


@pytest.mark.slow
def test_openai_videos_api_jobs_at_tp2_and_tp2_ulysses2_across_sigterm_and_kill(history, wan):
    long, fox = history["created"]
    assert (long.status, long.progress, long.object, long.model, long.size) == ("queued", 0, "video", "wan2.2",
                                                                                "32x32")
    assert fox.status == "queued" and fox.seconds == "0.625"  # 5 frames at 8 fps
    assert history["fox while long runs"] == "queued"
    first, second = history["rising"]
    assert 1 <= first.progress < second.progress < 100  # by denoising steps: 300 of them
    page = history["first page"]
    assert [video.id for video in page.data] == [fox.id] and page.has_more and page.last_id == fox.id
    assert history["all pages"] == [long.id, fox.id]  # the client followed `after` page by page
    assert history["deleted"].deleted and history["deleted"].object == "video.deleted"
    assert 0 < history["cancelled steps"] < 300  # the running job stopped at a step
    assert "was deleted" in history["deleted retrieve"] and "no video 'video_unknown'" in history["unknown"]
    assert "spritesheet" in history["spritesheet"]

    # the job's MP4 holds the frames `paradiff generate` writes; its thumbnail is the first of them exactly
    assert history["fox"].progress == 100 and history["fox"].completed_at >= history["fox"].created_at
    assert_video(history["mp4"], wan, "answer.mp4")
    assert_first_frame(history["thumbnail"], wan["frames"])

    # SIGTERM: the running job finished, the queued ones stayed queued; the restart ran them
    running, queued = history["sigterm"]
    assert history["sigterm exit"] == 0
    assert history["after sigterm"] == {fox.id: "completed", running: "completed", **dict.fromkeys(queued, "queued")}
    assert set(history["after restart"].values()) == {"completed"}
    # run at tp2 x ulysses2 after the restart: the same request, the same video as single-process diffusers
    assert "on 4 rank(s), 1 replica(s)" in history["restart ready"]
    assert_video(history["restart mp4"], wan, "restart.mp4")
    assert_first_frame(history["restart thumbnail"], wan["frames"])
    # kill -9: every id is known, none queued or in progress; the killed job says why
    killed, waiting = history["killed"]
    states = {video_id: video.status for video_id, video in history["after kill"].items()}
    assert states == {fox.id: "completed", running: "completed", **dict.fromkeys(queued, "completed"),
                      killed: "failed", waiting: "completed"}
    error = history["after kill"][killed].error
    assert error.code == "server_restarted" and "stopped while this job ran" in error.message
    # --keep-results 2: the oldest results expired (still listed), their content answers 410
    assert history["expired"].status_code == 410 and "expired" in str(history["expired"])
    # what a video server refuses, and the schema of what it serves
    refused = history["image request"]
    assert refused.status_code == 400 and "makes videos; use /v1/videos" in refused.text
    assert "frames 0 is out of bounds" in history["frames 0"]
    paths = history["paths"]
    assert {"/v1/videos", "/v1/videos/{video_id}", "/v1/videos/{video_id}/content"} <= set(paths)
    assert "/v1/images/generations" not in paths  # only what the pipeline serves
    # a second server on the same store: each answers the other's jobs and content; the one it was sent to ran it
    shared = history["shared"]
    assert shared["status"] == "completed" and shared["content"] == shared["own content"]
    assert len(shared["owners"]) == 2 and shared["ran on"] in shared["owners"]
    assert shared["owners after"] == sorted(set(shared["owners"]) - {shared["ran on"]})  # the stopped one ran it
    assert_video(shared["made mp4"], wan, "shared.mp4")  # seed 3: the fox's frames, run by the other server
    assert paths["/v1/videos"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"][
        "frames"]["maximum"] == 10  # twice --frames 5


@pytest.mark.slow
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no chromium here (Debian: apt-get install chromium)")
def test_the_web_page_generates_a_video_with_a_progress_bar_in_a_real_browser(history, tmp_path):
    """Debian's chromium, headless, driven by playwright: the page at / lists the pipeline's choices; a prompt typed
    and Generate clicked show the progress bar (fed by the job's progress) and then the video and its first frame."""
    from playwright.sync_api import sync_playwright

    server = history["server"]
    with sync_playwright() as playwright:
        browser = launch_chromium(playwright)
        try:
            page = browser.new_page(viewport={"width": 900, "height": 640})
            page.goto(server.url + "/")
            page.get_by_text("wan2.2: videos").wait_for(timeout=30_000)
            assert page.locator("#size option").all_inner_texts()[0] == "32x32"
            page.get_by_label("Prompt").fill("a fox in the snow")
            page.get_by_label("Seed").fill("3")
            page.get_by_label("Steps").fill("2")
            page.get_by_role("button", name="Generate").click()
            bar = page.get_by_role("progressbar")
            bar.wait_for(state="visible", timeout=120_000)
            page.wait_for_function("document.querySelector('[role=progressbar]').getAttribute('aria-valuenow')"
                                   " === '100'", timeout=120_000)
            # "done" is said once this job's figure is in the gallery (put first); the jobs listed from before are
            # appended as their files arrive, so until then the first figure may be one of theirs.
            page.wait_for_function("document.querySelector('#status').textContent === 'done'", timeout=60_000)
            image = page.locator("#gallery figure img").first
            image.wait_for(state="visible", timeout=60_000)
            page.wait_for_function("(image) => image.complete", arg=image.element_handle(), timeout=30_000)
            assert page.evaluate("(image) => image.naturalWidth", image.element_handle()) == 32
            assert page.locator("#gallery figure video").count() >= 1
            assert "a fox in the snow" in page.locator("#gallery figcaption").first.inner_text()
            assert not page.locator("#keybox").is_visible()  # no --api-key: no key asked
            page.locator("#gallery figure").nth(1).wait_for(timeout=30_000)  # the jobs done before, listed
            # docs/web-page.png: PARADIFF_SCREENSHOT=docs/web-page.png pytest tests/test_serve_jobs.py -k web_page
            shot = os.environ.get("PARADIFF_SCREENSHOT") or str(tmp_path / "web-page.png")
            page.screenshot(path=shot, full_page=True)
        finally:
            browser.close()
