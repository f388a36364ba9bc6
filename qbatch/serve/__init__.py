"""`qbatch serve`: OpenAI's Batch API over HTTP, on a warm Session (the third door onto the same run).

objects.py: ids and the File/Batch objects as the `openai` SDK types them; config.py: the service's
settings; requests.py: checks of an uploaded batch file; store.py: files and batches in SQLite;
worker.py: the FIFO thread running batches through `Session.run`; app.py: the FastAPI routes and
OpenAI's error shape; server.py: binding, authentication rules, signals; runs.py: the jobs `qbatch run
--server` hands over, client.py its side (standard library only) and wire.py what they say to each other.
"""
