#!/usr/bin/env bash
# Install the Debian packages the local two-node Slurm test cluster needs.
# Idempotent: apt-get runs only when a package is missing, so CI can call it on
# every run. Must run as root (CI does; the pytest fixture calls it likewise).
set -euo pipefail

packages=(slurmctld slurmd slurm-client munge iproute2 util-linux)

missing=()
for pkg in "${packages[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
    if [[ "$status" != "install ok installed" ]]; then
        missing+=("$pkg")
    fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
    echo "install_slurm.sh: all packages present (${packages[*]})"
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "install_slurm.sh: must run as root to install: ${missing[*]}" >&2
    exit 1
fi

echo "install_slurm.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# The tests start their own daemons with their own config; keep the package
# scripts from starting munged/slurmd with the system defaults (on a machine
# without systemd, invoke-rc.d would fall back to the init.d scripts).
policy=/usr/sbin/policy-rc.d
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    trap 'rm -f "$policy"' EXIT
fi
apt-get update -q
# --no-install-recommends keeps the install small.
apt-get install -y -q --no-install-recommends "${missing[@]}"
