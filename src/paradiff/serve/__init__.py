"""`paradiff serve`: the pipeline loaded once on the mesh, serving many requests over HTTP.

    settings.py   ServeSettings: every server setting and the LoadSpec each replica loads, typed and checked
    protocol.py   what a request may ask (OpenAI's image fields plus paradiff's) and its checks, as 4xx errors
    images.py     output formats (PNG from the ranks, re-encoded on rank 0), the edits' multipart form and uploads
    scheduler.py  the bounded queue: cost-aware order (fair | fifo), expected wait, deadlines, batching of
                  compatible requests for each free replica
    metrics.py    counters and the latency histogram, as Prometheus text
    safety.py     what is refused before a body is read (Host, Origin, Content-Type, slow clients); error messages
                  without internal details
    schema.py     the OpenAPI document of the loaded pipeline (bounds, patterns, error answers)
    jobs.py       the asynchronous video jobs (/v1/videos) and their SQLite store, which survives restarts
    static/       the web page at GET / (plain HTML and JavaScript over the public API)
    app.py        the HTTP endpoints (FastAPI), on rank 0
    ranks.py      the loop every rank runs, one per replica (a process group each); recovery after a fault
    dispatch.py   rank 0's dispatcher: each free replica's next batch, its answers, a replica's fault's outcome

Every scheduling decision is rank 0's and reaches a replica's ranks through the store and one broadcast by the
replica's first rank (JSON, paradiff.distributed.comm.broadcast_json); the other ranks never decide on their own
clocks. Nothing that crosses
the store or a collective is unpickled (paradiff.distributed.store).
"""
