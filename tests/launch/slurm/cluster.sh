#!/bin/bash
# A throw-away Slurm cluster on localhost for the tests: Debian's slurm-wlm as root, no systemd or cgroups,
# N simulated nodes (n1..nN, multiple-slurmd) or one node named after this host. cred_expire=10: a requeued
# job may start again after 10 s instead of the default 120 s (the credential lifetime is also the requeue delay).
#   cluster.sh up DIR [N]   install slurm-wlm if needed, start munged, slurmctld and N slurmd; print SLURM_CONF
#   cluster.sh down DIR     cancel jobs, stop slurmd, slurmctld, munged (in that order), drop the /etc/hosts lines
set -euo pipefail
cmd=${1:?up|down}; D=${2:?state directory}; N=${3:-1}
export SLURM_CONF=$D/slurm.conf
TAG="# mcit-test-slurm $D"
PORT=${MCIT_SLURM_PORT:-6817}
stop() { [ -f "$1" ] || return 0; local p; p=$(cat "$1"); kill "$p" 2>/dev/null || true
  for _ in $(seq 150); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done; kill -9 "$p" 2>/dev/null || true; rm -f "$1"; }
case $cmd in
up)
  if ! command -v slurmctld >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm >/dev/null; }
  fi
  H=$(hostname -s)
  if [ "$N" -eq 1 ]; then NODES=$H; else NODES=$(seq -f 'n%g' -s ' ' 1 "$N"); fi
  rm -rf "$D/state" "$D/spool"; mkdir -p "$D/state" "$D/log"; chmod 711 "$D"
  for n in $NODES; do
    mkdir -p "$D/spool/$n"
    getent hosts "$n" >/dev/null || echo "127.0.0.1 $n $TAG" >> /etc/hosts   # MASTER_ADDR = a node name
  done
  HW=$(slurmd -C | head -1 | sed -e 's/^NodeName=[^ ]* //' -e 's/RealMemory=[0-9]*/RealMemory=1000/')
  cat > "$SLURM_CONF" <<CONF
ClusterName=mcittest
SlurmctldHost=$H(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$D/munge.socket,cred_expire=10
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.%n.pid
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
KillWait=10
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$D/log/jobcomp.txt
NodeName=${NODES// /,} NodeHostname=$H NodeAddr=127.0.0.1 Port=$((PORT+1))-$((PORT+N)) $HW State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  [ -f "$D/munge.key" ] || { dd if=/dev/urandom of="$D/munge.key" bs=1024 count=1 status=none; chmod 400 "$D/munge.key"; }
  munged -S "$D/munge.socket" --key-file="$D/munge.key" --pid-file="$D/munged.pid" --log-file="$D/log/munged.log" \
    --seed-file="$D/munged.seed"
  slurmctld
  for n in $NODES; do slurmd -N "$n"; done
  for _ in $(seq 150); do [ "$(sinfo -h -N -o %T 2>/dev/null | grep -c idle)" = "$N" ] && break; sleep 0.2; done
  [ "$(sinfo -h -N -o %T 2>/dev/null | grep -c idle)" = "$N" ] || { echo "nodes did not come up: $(sinfo -N 2>&1)" >&2; exit 1; }
  echo "$SLURM_CONF" ;;
down)
  ids=$(squeue -h -o %A 2>/dev/null || true); [ -z "$ids" ] || scancel $ids 2>/dev/null || true
  for _ in $(seq 50); do [ -z "$(squeue -h 2>/dev/null || true)" ] && break; sleep 0.2; done
  for f in "$D"/slurmd.*.pid "$D/slurmctld.pid" "$D/munged.pid"; do stop "$f"; done
  if grep -qF "$TAG" /etc/hosts; then grep -vF "$TAG" /etc/hosts > "$D/hosts.tmp" || true; cat "$D/hosts.tmp" > /etc/hosts; fi ;;
*) echo "usage: $0 up DIR [N] | down DIR" >&2; exit 2 ;;
esac
