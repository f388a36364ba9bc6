"""Object storage (s3://, gs://, hf://) as inputs and output folders: each object read or written whole,
through a local copy (spool.py, stage.py), the output's lock an object made with a conditional write (lock.py).
Everything else in qbatch reads and writes local files only."""
