#!/usr/bin/env bash
# A cron wrapper for a daily qbatch job: run it, then act on qbatch's exit code.
#
# Cron starts it every hour; the first start of the day does the day's job, later ones find it
# done (seconds, no engine started), still running (exit 75: left alone), or stopped (they resume):
#   0 * * * *  cd /opt/qbatch && jobs/qbatch_cron.sh >> /var/log/qbatch/cron.log 2>&1
#
# QBATCH_JOB (a job file), QBATCH_INPUTS and QBATCH_OUT override the defaults below, which run the
# quick start's job on the bundled model: `jobs/qbatch_cron.sh` tries it offline in a clone.
set -uo pipefail

job=${QBATCH_JOB:-jobs/quickstart.toml}
out=${QBATCH_OUT:-out/cron/$(date +%F)}
inputs=${QBATCH_INPUTS:-}
# SIGTERM at the limit: qbatch keeps its finished parts and exits 143; the next start resumes.
limit=${QBATCH_TIME_LIMIT:-6h}

# shellcheck disable=SC2086  # QBATCH_INPUTS may hold several paths or globs
timeout --preserve-status "$limit" qbatch run --job "$job" $inputs -o "$out" --progress log --fail-on-row-errors
code=$?

case $code in
  0)  qbatch report "$out" > /dev/null ;;                                 # done: OUT/report.html
  4)  qbatch report "$out" > /dev/null
      echo "qbatch: rows failed, their reasons are in $out/errors.parquet" >&2 ;;  # alert: look at the rows
  75) echo "qbatch: a run still holds $out; leaving it alone" >&2
      exit 0 ;;                                                          # not an error: it is working
  129|130|143)
      echo "qbatch: stopped by a signal (exit $code); the next start resumes" >&2 ;;
  6)  echo "qbatch: the engine failed (exit 6): the next start resumes, unless the message names a memory flag to set" >&2 ;;
  2|3|5)
      echo "qbatch: the job, its inputs or its output folder need a fix (exit $code): see the message above" >&2 ;;
  *)  echo "qbatch: failed (exit $code)" >&2 ;;
esac
exit $code
