#!/bin/sh
# Fetch the model (a built-in name: downloaded into $JAXINFER_CACHE_DIR once; a path: only
# checked), then serve it on every interface. Arguments are passed on to `jaxinfer serve`.
set -eu
jaxinfer fetch --model "$MODEL" >/dev/null
exec jaxinfer serve --model "$MODEL" --host 0.0.0.0 --port "$PORT" "$@"
