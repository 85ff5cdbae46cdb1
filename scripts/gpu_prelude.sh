# Source this first on the GPU machine (from the repository root): installs the wheels carried in
# ./.whl/ (numpy 2.4 for numba-cuda) in front of the image's own packages, then installs this
# project editable without touching its dependencies. Same steps as shared/gpu/prelude.sh.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null || python3 -m pip install -q --no-deps -e . || return 1
python3 -c "import numpy, numba, numba.cuda, cupy; print('numpy', numpy.__version__, '| numba', numba.__version__, '| cupy', cupy.__version__, '|', cupy.cuda.runtime.getDeviceProperties(0)['name'].decode())"
