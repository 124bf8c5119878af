# Sourced by bench/gpu/run.sh and bench/gpu/amx.sh: `install`, which puts the carried
# wheels (.whl/, from bench/gpu/fetch_wheels.sh) into $WORK/site unless every package
# dpserve needs imports already. Needs PY, ROOT and WORK set and exported.
export IMPORTS="import msgspec, zmq, fastapi, uvicorn, pydantic, gguf, xgrammar, \
setproctitle, jsonschema, openai, transformers, tokenizers, safetensors, httpx, psutil"
export PY ROOT WORK
install() {
  if "$PY" -c "$IMPORTS" 2>/dev/null; then
    echo "every package imports already: nothing installed"
    return 0
  fi
  ls .whl/*.whl >/dev/null || { echo "no .whl/*.whl: run bench/gpu/fetch_wheels.sh, carry .whl"; return 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$WORK/site" .whl/*.whl || return 1
  local path="$ROOT:$WORK/site${PYTHONPATH#"$ROOT"}"
  PYTHONPATH=$path "$PY" -c "$IMPORTS" && { echo "installed"; return 0; }
  echo "the carried transformers does not import here: the image's instead"
  rm -rf "$WORK"/site/transformers "$WORK"/site/transformers-*.dist-info
  PYTHONPATH=$path "$PY" -c "$IMPORTS" && echo "installed (transformers: the image's)"
}
