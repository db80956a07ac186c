#!/usr/bin/env bash
# Start a single-node SLURM cluster on this machine, for tests.
#
#   bash launch/slurm/start_local_cluster.sh          # start (no-op when already up)
#   bash launch/slurm/start_local_cluster.sh --stop   # stop the daemons
#
# Needs root and Debian's packages, which this script does not install:
#   apt-get update && apt-get install -y slurmctld slurmd slurm-client munge
#
# It writes /etc/slurm/slurm.conf and gres.conf (one node at 127.0.0.1 with 8+
# task slots, eight fake GPUs and one partition, `debug`), creates the spool,
# log and run directories, starts munged, slurmctld and slurmd without
# systemd, and waits until `sinfo` reports the node idle. Run again, it
# restarts only what is down, or everything when its configuration changed.
# It never overwrites configuration it did not write: a machine with its own
# SLURM set-up is used as it is when `sinfo` shows a usable node.
# Exit status: 0 cluster up, 1 could not start it, 2 SLURM not installed.
set -euo pipefail

readonly CONF=/etc/slurm/slurm.conf
readonly GRES_CONF=/etc/slurm/gres.conf
readonly MARKER="# Written by jdp launch/slurm/start_local_cluster.sh"
readonly LOG_DIR=/var/log/slurm
readonly FAKE_GPU_DIR=/run/jdp-fake-gpus
readonly START_TIMEOUT_S=${JDP_SLURM_START_TIMEOUT_S:-60}

log() { echo "start_local_cluster: $*" >&2; }

# A pid file whose process is alive and not a zombie (finished daemons linger
# as zombies on some machines, and `kill -0` succeeds on those).
daemon_alive() {
  local pid_file=$1 pid state
  [[ -s $pid_file ]] || return 1
  pid=$(<"$pid_file")
  kill -0 "$pid" 2>/dev/null || return 1
  state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || echo Z)
  [[ $state != Z ]]
}

stop_daemon() {
  local pid_file=$1
  if daemon_alive "$pid_file"; then
    kill "$(<"$pid_file")"
    for _ in $(seq 50); do daemon_alive "$pid_file" || return 0; sleep 0.2; done
    kill -9 "$(<"$pid_file")" 2>/dev/null || true
  fi
}

# Some node is in a state where a job can be scheduled right away.
cluster_usable() {
  local states
  states=$(timeout 10 sinfo -h -o %T 2>/dev/null) || return 1
  grep -qE '^(idle|mixed|allocated|completing)' <<<"$states"
}

cluster_summary() { timeout 10 sinfo -h -o '%P %D %T %G' 2>&1 | tr '\n' ' '; }

# Writes a configuration file if its content changed; returns 0 if it did.
write_if_changed() {
  local file=$1 content=$2
  [[ $content != "$(cat "$file" 2>/dev/null)" ]] || return 1
  printf '%s\n' "$content" >"$file"
}

if [[ ${1:-} == --stop ]]; then
  stop_daemon /run/slurmd.pid
  stop_daemon /run/slurmctld.pid
  stop_daemon /run/munge/munged.pid
  exit 0
fi

for cmd in slurmctld slurmd sinfo srun munged; do
  if ! command -v "$cmd" >/dev/null; then
    log "'$cmd' not found; install with:" \
      "apt-get update && apt-get install -y slurmctld slurmd slurm-client munge"
    exit 2
  fi
done

# Someone else's cluster (their configuration, or we may not touch /etc):
# usable as it is, or not at all.
foreign=""
for file in "$CONF" "$GRES_CONF"; do
  if [[ -e $file ]] && ! grep -qF "$MARKER" "$file"; then foreign=$file; fi
done
if [[ -n $foreign || $(id -u) -ne 0 ]]; then
  if cluster_usable; then
    log "using the existing cluster: $(cluster_summary)"
    exit 0
  fi
  log "no usable cluster, and cannot set one up:" \
    "${foreign:+$foreign was not written by this script}${foreign:-not root}"
  exit 1
fi

host=$(hostname -s)
# At least 8 task slots, whatever the core count: test jobs oversubscribe.
cpus=$(( $(nproc) > 8 ? $(nproc) : 8 ))
# The fake GPUs are links to /dev/null (slurmd wants character devices): jobs
# asking for --gpus-per-task get scheduled and see CUDA_VISIBLE_DEVICES as on a
# GPU node, which lets tests check the GPU bookkeeping of launch/slurm/jdp.sbatch.
conf="$MARKER
ClusterName=local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
GresTypes=gpu
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE"
gres_conf="$MARKER
NodeName=$host Name=gpu File=$FAKE_GPU_DIR/nvidia[0-7]"

mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd "$LOG_DIR" /run/munge "$FAKE_GPU_DIR"
for i in {0..7}; do ln -sfn /dev/null "$FAKE_GPU_DIR/nvidia$i"; done
changed=0
write_if_changed "$CONF" "$conf" && changed=1
write_if_changed "$GRES_CONF" "$gres_conf" && changed=1
if (( changed )); then
  # Running daemons would keep the old configuration.
  stop_daemon /run/slurmd.pid
  stop_daemon /run/slurmctld.pid
fi

if ! daemon_alive /run/munge/munged.pid; then
  # Debian creates the key on install; make one if it is missing.
  [[ -s /etc/munge/munge.key ]] || mungekey --create
  chown -R munge:munge /etc/munge /run/munge
  chmod 700 /etc/munge
  chmod 600 /etc/munge/munge.key
  # --force: a stale socket left by a killed munged must not stop it.
  runuser -u munge -- munged --force
fi
# Both daemonise.
daemon_alive /run/slurmctld.pid || slurmctld
daemon_alive /run/slurmd.pid || slurmd

deadline=$(( SECONDS + START_TIMEOUT_S ))
until cluster_usable; do
  if (( SECONDS >= deadline )); then
    log "node not usable after ${START_TIMEOUT_S}s; sinfo: $(cluster_summary)"
    log "see $LOG_DIR/slurmctld.log and $LOG_DIR/slurmd.log"
    exit 1
  fi
  # A node left down or drained by an earlier run's saved state: bring it back.
  if timeout 10 sinfo -h -o %T 2>/dev/null | grep -qE '^(down|drain)'; then
    timeout 10 scontrol update NodeName="$host" State=RESUME 2>/dev/null || true
  fi
  sleep 0.5
done
log "cluster up after ${SECONDS}s: $(cluster_summary)"
