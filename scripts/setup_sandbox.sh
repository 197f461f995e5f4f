#!/usr/bin/env bash
# Install bubblewrap, the sandbox strop prefers for model-written code (strop/tools/sandbox.py),
# where this user can install packages (root with apt-get). Without it strop falls back to unshare
# namespaces (util-linux), and refuses to run model code with neither unless told by name.
set -uo pipefail
if command -v bwrap >/dev/null 2>&1; then
    echo "sandbox: bubblewrap $(bwrap --version 2>/dev/null | awk '{print $2}') is installed"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q --no-install-recommends bubblewrap >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends bubblewrap >/dev/null 2>&1; }) \
        && echo "sandbox: installed bubblewrap" || echo "sandbox: could not install bubblewrap; unshare namespaces will be used"
else
    echo "sandbox: bubblewrap is not installed (Debian/Ubuntu: sudo apt-get install bubblewrap); unshare namespaces will be used"
fi
# strop runs bwrap with --disable-userns and --size (bubblewrap 0.8.0, Debian 12 / Ubuntu 23.04 and later)
if command -v bwrap >/dev/null 2>&1 && ! bwrap --help 2>&1 | grep -q -- --disable-userns; then
    echo "sandbox: bubblewrap $(bwrap --version 2>/dev/null | awk '{print $2}') is older than 0.8.0 (no --disable-userns); unshare namespaces will be used"
fi
exit 0
