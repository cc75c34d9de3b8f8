#!/usr/bin/env bash
# The Python packages plait needs that the GPU machine's image lacks, carried as wheels in .whl/
# (ignored by git: name it in the device call's `carry`).
#   bash benchmarks/wheels.sh download   # here, with a package registry: the wheels for CPython 3.12
#   bash benchmarks/wheels.sh install    # there, first thing in a device call
# `install` skips what the machine has (by distribution name) and installs with `python -m pip`: the
# bare `pip` there belongs to another interpreter than the `python` that runs plait.
set -uo pipefail
PACKAGES=(xgrammar apache-tvm-ffi gguf fastapi starlette annotated-doc opentelemetry-api importlib-metadata zipp
          uvicorn httptools uvloop orjson pyzmq httpx httpcore h11 anyio sniffio pydantic pydantic-core
          annotated-types typing-inspection prometheus-client ninja pyyaml requests tqdm)
case ${1:-} in
  download)
    mkdir -p .whl
    pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --no-deps \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      -d .whl "${PACKAGES[@]}" ;;
  install)
    for w in .whl/*.whl; do
      d=$(basename "$w" | cut -d- -f1)
      python -m pip show "${d//_/-}" >/dev/null 2>&1 && continue
      python -m pip install -q --no-index --no-deps --root-user-action=ignore "$w" 2>&1 | tail -1
    done
    python -c "import xgrammar, gguf, fastapi, uvicorn, zmq" && echo "wheels: plait's imports work" ;;
  *) echo "usage: bash benchmarks/wheels.sh download|install" >&2; exit 2 ;;
esac
