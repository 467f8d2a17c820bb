# Sourced by the GPU scripts: the peers from .peers/ (the wheels of shared/peers copied into that ignored folder),
# unpacked and installed into /tmp/peers and put on PYTHONPATH; nothing when .peers/ holds no wheel.
mkdir -p /tmp/peers
if ls .peers/*.whl >/dev/null 2>&1; then
  tar xzf .peers/causal_conv1d-*-site.tgz -C /tmp/peers &&
  python3 -m pip install -q --no-index --no-deps --target /tmp/peers .peers/*.whl
  export PYTHONPATH=/tmp/peers:${PYTHONPATH:-}
fi
