"""Asynchronous video jobs (serve/jobs.py): the SQLite store and its restart rules in-process with the real
scheduler; then OpenAI's own client against a tiny Wan server at tp2, restarted after SIGTERM and after kill -9, and
the web page in a real headless browser."""

from __future__ import annotations

import io
import shutil
import sqlite3
import time
from pathlib import Path

import numpy as np
import pytest

from paradiff.serve.jobs import Jobs, JobStore, form_fields, keep_results, video_object
from paradiff.serve.protocol import Limits, RequestError
from paradiff.serve.scheduler import Scheduler

LIMITS = Limits(kind="video", model_name="wan", default_size=(32, 32), default_frames=5, max_frames=10,
                accepts=frozenset({"num_frames"}))


def _files(tag: bytes) -> dict:
    return {"files": [{"mime": "video/mp4", "data": b"mp4" + tag}, {"mime": "image/png", "data": b"png" + tag}],
            "replica": 0, "started": 0.0, "finished": 0.0}


def test_job_store_keeps_jobs_across_restarts_and_expires_results_by_count(tmp_path):
    """In-process, the real scheduler standing in for the ranks: a job runs, completes and is downloadable; at a drain
    the waiting jobs leave the scheduler and stay queued; a reopened store fails the job that was running when the
    process died (server_restarted) and submits the queued ones again; --keep-results 2 expires the oldest result
    (listed, content 410); a deleted id says so."""
    db = tmp_path / "jobs.db"
    scheduler = Scheduler(max_queue=8)
    jobs = Jobs(JobStore(db), tmp_path / "jobs", keep_results("2"), scheduler)
    assert jobs.store.journal_mode() == "wal"
    jobs.ready(LIMITS)
    first = jobs.create({"prompt": "a fox", "seed": 3, "steps": 2}, LIMITS, max_queue=8)
    assert video_object(first)["status"] == "queued" and first["progress"] == 0
    second = jobs.create({"prompt": "a cat", "seconds": 1, "fps": 4}, LIMITS, max_queue=8)
    assert second["params"]["frames"] == 5 and second["seconds"] == "1.25"  # seconds * fps + 1 frames
    third = jobs.create({"prompt": "a dog"}, LIMITS, max_queue=8)
    round_ = scheduler.next_round(1, 0)
    (item,) = round_["batches"][0]
    jobs.started([item["id"]])
    jobs.progress(item["id"], 1, 2)
    assert jobs.known(first["id"])["status"] == "in_progress" and jobs.known(first["id"])["progress"] == 50
    scheduler.complete(item["id"], 200, _files(b"1"))
    done = jobs.known(first["id"])
    assert done["status"] == "completed" and done["progress"] == 100
    path, mime = jobs.content(first["id"], "thumbnail")
    assert path.read_bytes() == b"png1" and mime == "image/png"
    round_ = scheduler.next_round(1, 0)  # the second job runs; the third waits
    jobs.started([round_["batches"][0][0]["id"]])
    jobs.hold()  # SIGTERM: the third leaves the scheduler, still queued
    assert scheduler.depth() == (0, 1) and jobs.known(third["id"])["status"] == "queued"
    jobs.store.close()  # killed here, the second job still running

    scheduler = Scheduler(max_queue=8)
    jobs = Jobs(JobStore(db), tmp_path / "jobs", keep_results("2"), scheduler)
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
    assert not (tmp_path / "jobs" / first["id"]).exists() and jobs.known(first["id"])["expires_at"] is not None
    page, more = jobs.store.page(None, 2, "desc")
    assert [job["id"] for job in page] == [fourth["id"], third["id"]] and more
    page, more = jobs.store.page(third["id"], 2, "desc")
    assert [job["id"] for job in page] == [second["id"], first["id"]] and not more
    assert jobs.delete(fourth["id"])
    with pytest.raises(RequestError, match="was deleted"):
        jobs.known(fourth["id"])
    with pytest.raises(RequestError, match="no video 'video_x'"):
        jobs.known("video_x")
    with pytest.raises(RequestError, match="queue is full"):
        jobs.hold()
        for _ in range(3):
            jobs.create({"prompt": "x"}, LIMITS, max_queue=2)
    with pytest.raises(RequestError, match="n: a video job makes one video"):
        jobs.create({"prompt": "x", "n": 2}, LIMITS, max_queue=8)
    jobs.store.close()


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
