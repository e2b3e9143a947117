# Sourced by the device-tool scripts (bench/run_gpu*.sh) from the repository root, with .whl
# carried: installs the carried wheels and this working tree into $SITE (kernels/ and patches/
# only become mindspeed_cez.kernels / .patches through the install), puts $SITE on PYTHONPATH,
# keeps NVLink multicast off, and makes $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
OUT=${OUT:-$PWD/out}
SITE=${SITE:-/tmp/site}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: carry .whl" >&2; exit 2; }
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
$PY -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$SITE" . || exit 1
export PYTHONPATH=$SITE
