#!/usr/bin/env bash
# Install the SLURM that tests/test_slurm.py runs: a one-node cluster (slurmctld + slurmd on
# this machine, configured by the test in its temporary folder) that runs the sbatch script
# `python -m labkit slurm` writes.
#
# Debian's packages, the fewest that work: slurmctld (the controller), slurmd (the node's
# daemon), slurm-client (sbatch, srun, sinfo, scontrol) and munge (the credentials the daemons
# and clients sign their messages with). --no-install-recommends leaves out what the test
# does not use (the slurm-wlm meta package, docs, MPI's PMIx libraries). Nothing is started
# here: the test starts its own munged, slurmctld and slurmd, and stops them.
# Idempotent: does nothing when the programs are already installed. Without root or apt-get it
# prints what to do and exits 0: the SLURM test then skips locally (and fails in CI).
set -euo pipefail

NEEDED=(/usr/sbin/slurmctld /usr/sbin/slurmd /usr/bin/sbatch /usr/bin/srun /usr/sbin/munged)
missing=()
for exe in "${NEEDED[@]}"; do
  [ -x "$exe" ] || missing+=("$exe")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_slurm: SLURM and munge are already installed ($(/usr/sbin/slurmctld -V))"
  exit 0
fi

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "install_slurm: installing Debian's slurmctld slurmd slurm-client munge"
  start=$(date +%s)
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  echo "install_slurm: $(/usr/sbin/slurmctld -V) installed in $(( $(date +%s) - start )) s"
  exit 0
fi

cat <<MSG
install_slurm: missing ${missing[*]}, and this script can only install them as root with apt-get.
  Debian/Ubuntu:  sudo apt-get install --no-install-recommends slurmctld slurmd slurm-client munge
Until then tests/test_slurm.py's cluster test skips (in CI, where CI=true, it fails instead).
MSG
exit 0
