#!/bin/sh
# The executable of the processes an engine's start spawns (vllm_output.engine_processes): Python, with
# stdout and stderr on the engine log from the first line they write.
exec "$QBATCH_ENGINE_PYTHON" "$@" >>"$QBATCH_ENGINE_LOG" 2>&1
