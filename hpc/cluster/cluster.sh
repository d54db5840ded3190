#!/usr/bin/env bash
# A cluster of several nodes on one machine, for trying and testing multi-node jobs (root, Linux namespaces).
#   hpc/cluster/cluster.sh up [N]     N nodes (default 3): node1..nodeN
#   hpc/cluster/cluster.sh down       every node, the bridge, the /etc/hosts lines and the run directory gone
#   hpc/cluster/cluster.sh status     the nodes and their addresses (exit 1 when the cluster is not up)
#   hpc/cluster/cluster.sh kill NODE  every process of NODE killed at once and its node-local disk gone (a lost node)
# Each node is a network namespace with an address on a private bridge (SUBNET.11, .12, ...), its own hostname
# (a UTS namespace) and its own tmpfs at the node-local path (a mount namespace): Open MPI sees separate hosts and
# talks TCP between them. Run jobs with hpc/cluster/mpirun, or under Slurm: where Slurm is installed, every node
# runs its own slurmd, and slurmctld and a munged of the cluster's own run on the machine (partition "local";
# export SLURM_CONF=/run/mpiscale-cluster/slurm/slurm.conf, then sbatch, srun, squeue as usual). Settings:
#   MPISCALE_CLUSTER_SUBNET  the first three numbers of the bridge's /24 (default 10.77.0)
#   MPISCALE_CLUSTER_LOCAL   the node-local path, a private tmpfs on every node (default /mnt/mpiscale-local)
#   MPISCALE_CLUSTER_LOCAL_MIB  its size (default 512)
#   MPISCALE_CLUSTER_CPUS    the CPUs each node declares to Slurm (default 2: they share the machine's cores)
#   MPISCALE_CLUSTER_SLURM   0: no Slurm even where it is installed
set -euo pipefail

subnet="${MPISCALE_CLUSTER_SUBNET:-10.77.0}"
local_path="${MPISCALE_CLUSTER_LOCAL:-/mnt/mpiscale-local}"
local_mib="${MPISCALE_CLUSTER_LOCAL_MIB:-512}"
cpus="${MPISCALE_CLUSTER_CPUS:-2}"
run=/run/mpiscale-cluster
slurm="$run/slurm"
bridge=mpiscale-br0
tag="# mpiscale-cluster"

die() { echo "hpc/cluster: $*" >&2; exit 2; }

preflight() {
    [[ "$(id -u)" == 0 ]] || die "must run as root (it makes network, UTS and mount namespaces, a bridge and mounts)"
    local tool
    for tool in ip unshare nsenter setsid mount; do
        command -v "$tool" >/dev/null || die "$tool is not installed (Debian: iproute2, util-linux)"
    done
    local kind
    for kind in net uts mnt; do
        [[ -e /proc/self/ns/$kind ]] || die "this kernel has no $kind namespaces"
    done
    unshare --uts --mount true 2>/dev/null || die "this kernel or container refuses new namespaces (unshare --uts --mount)"
    ip link add mpiscale-probe type bridge 2>/dev/null && ip link del mpiscale-probe \
        || die "cannot make a bridge here (no CAP_NET_ADMIN, or no bridge module)"
}

nodes() { [[ -f "$run/nodes" ]] && cat "$run/nodes" || true; }

# alive: running, not a zombie left unreaped (the holder's parent is gone; not every init reaps)
holder_alive() {
    local pid state
    pid="$(cat "$run/$1.pid" 2>/dev/null)" && state="$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" \
        && [[ -n "$state" && "$state" != Z ]]
}

# every process of a node's network namespace killed at once, and gone (zombies aside) within 5 s
kill_namespace() {
    local ns="$1" waited=0 pid
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
    while ((waited++ < 50)); do
        local left=0
        for pid in $(ip netns pids "$ns" 2>/dev/null); do
            [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" == Z ]] || left=1
        done
        ((left)) || return 0
        sleep 0.1
    done
    echo "hpc/cluster: processes of $ns outlived SIGKILL for 5 s" >&2
    return 1
}

slurm_installed() {
    [[ "${MPISCALE_CLUSTER_SLURM:-1}" != 0 && -x /usr/sbin/slurmctld && -x /usr/sbin/slurmd && -x /usr/sbin/munged ]] \
        && command -v sinfo >/dev/null
}

# a TCP port nothing on the machine listens on, for slurmctld (a site's own Slurm keeps 6817)
free_port() {
    local port=16817
    while ss -Hltn "sport = :$port" | grep -q .; do ((port++)); done
    echo "$port"
}

slurm_conf() {  # $1: the node count
    local k
    cat <<EOF
# The local cluster's Slurm (written by hpc/cluster/cluster.sh up; gone at down)
ClusterName=mpiscale-local
SlurmctldHost=$(hostname -s)($subnet.1)
SlurmctldPort=$(free_port)
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job may start again 5 s after it ended (Slurm waits for its credentials to expire: 120 s by default)
AuthInfo=socket=$slurm/munge/socket,cred_expire=5
MailProg=/bin/true
# job temporary files (PMIx's too) on each node's own disk: /tmp is one directory shared by every node here
TmpFS=$local_path
StateSaveLocation=$slurm/state
SlurmdSpoolDir=$slurm/spool/%n
SlurmctldPidFile=$slurm/slurmctld.pid
SlurmdPidFile=$slurm/slurmd-%n.pid
SlurmctldLogFile=$slurm/log/slurmctld.log
SlurmdLogFile=$slurm/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerParameters=sched_interval=1,sched_min_interval=100000
# a node whose slurmd stops answering is DOWN after 10 s (sites: minutes), and its jobs are requeued (--requeue)
SlurmdTimeout=10
# a node DOWN for not answering is back once its slurmd answers; one an admin set DOWN stays so (2 undid it at once)
ReturnToService=1
MinJobAge=600
MpiDefault=none
EOF
    for ((k = 1; k <= $1; k++)); do
        echo "NodeName=node$k NodeAddr=$subnet.$((10 + k)) CPUs=$cpus RealMemory=1000 State=UNKNOWN"
    done
    echo "PartitionName=local Nodes=node[1-$1] Default=YES MaxTime=INFINITE State=UP"
}

# munged (the cluster's own socket, the machine's key), slurmctld here, and a slurmd inside every node
start_slurm() {
    local count="$1" node waited=0
    mkdir -p "$slurm/state" "$slurm/log" "$slurm/munge"
    for node in $(nodes); do mkdir -p "$slurm/spool/$node"; done
    chown munge:munge "$slurm/munge"
    runuser -u munge -- /usr/sbin/munged --socket="$slurm/munge/socket" --pid-file="$slurm/munge/munged.pid" \
        --seed-file="$slurm/munge/seed" --log-file="$slurm/munge/munged.log" \
        || { down >/dev/null; die "munged did not start (is /etc/munge/munge.key there?)"; }
    slurm_conf "$count" >"$slurm/slurm.conf"
    export SLURM_CONF="$slurm/slurm.conf"
    /usr/sbin/slurmctld -f "$SLURM_CONF" || { down >/dev/null; die "slurmctld did not start"; }
    for node in $(nodes); do
        nsenter --target "$(cat "$run/$node.pid")" --uts --mount --net -- /usr/sbin/slurmd -f "$SLURM_CONF" \
            || { down >/dev/null; die "the slurmd of $node did not start"; }
    done
    until [[ "$(sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle$')" == "$count" ]]; do
        ((waited++ < 300)) || { sinfo -N >&2 || true; down >/dev/null; die "Slurm's nodes were not idle within 30 s"; }
        sleep 0.1
    done
}

# slurmctld and munged (each slurmd went with its node), by their pid files, then any other daemon started with the
# cluster's run directory (one whose pid file a later start overwrote), each gone within 10 s
stop_slurm() {
    local pid waited
    for pid in $(cat "$slurm/slurmctld.pid" "$slurm/munge/munged.pid" 2>/dev/null) \
        $(pgrep -f "^/usr/sbin/(slurmctld|munged|slurmd) .*$run/" || true); do
        kill -TERM "$pid" 2>/dev/null || continue
        waited=0
        while kill -0 "$pid" 2>/dev/null && ((waited++ < 100)); do sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    done
}

up() {
    local count="$1"
    [[ "$count" =~ ^[1-9][0-9]?$ ]] || die "up takes a number of nodes from 1 to 99, got '$count'"
    preflight
    if [[ -f "$run/nodes" ]]; then
        local alive=1 node
        for node in $(nodes); do holder_alive "$node" || alive=0; done
        if ((alive)) && [[ "$(nodes | wc -l)" == "$count" ]]; then
            echo "hpc/cluster: already up: $(nodes | tr '\n' ' ')"
            return 0
        fi
        # a whole cluster of another size runs jobs and keeps node-local data: taking it down is the user's call
        ((alive)) && die "a cluster of $(nodes | wc -l) nodes is up (its jobs and node-local data would go):" \
            "run 'hpc/cluster/cluster.sh down' first, then up $count"
        down >/dev/null  # one left half up (a node killed): start afresh
    fi
    mkdir -p "$run"
    [[ -d "$local_path" ]] || { mkdir -p "$local_path"; touch "$run/made-local-path"; }
    ip link add "$bridge" type bridge
    ip addr add "$subnet.1/24" dev "$bridge"
    ip link set "$bridge" up
    local k node ns
    for ((k = 1; k <= count; k++)); do
        node="node$k" ns="mpiscale-node$k"
        ip netns add "$ns"
        ip link add "mpiscale-v$k" type veth peer name eth0 netns "$ns"
        ip link set "mpiscale-v$k" master "$bridge" up
        ip -n "$ns" addr add "$subnet.$((10 + k))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        # the holder keeps the node's namespaces alive (setsid, nsenter, unshare and sh exec in turn, so $! is it), in
        # a session of its own: no signal to the caller's process group or terminal reaches it; it keeps the
        # machine's /sys, cgroups included, which slurmd needs (ip netns exec would mount a bare one)
        setsid nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation private sh -c \
            "hostname $node && mount -t tmpfs -o size=${local_mib}m mpiscale-$node '$local_path' && exec sleep infinity" \
            </dev/null >/dev/null 2>&1 &
        echo $! >"$run/$node.pid"
        disown  # it outlives this script; a later down kills it without a word from this shell
        echo "$node" >>"$run/nodes"
        echo "$subnet.$((10 + k)) $node $tag" >>/etc/hosts
    done
    for node in $(nodes); do
        local waited=0
        until [[ "$(nsenter --target "$(cat "$run/$node.pid")" --uts hostname 2>/dev/null)" == "$node" ]] \
            && grep -q " $local_path tmpfs" "/proc/$(cat "$run/$node.pid")/mounts" 2>/dev/null; do
            holder_alive "$node" || { down >/dev/null; die "$node did not start (its holder exited)"; }
            ((waited++ < 100)) || { down >/dev/null; die "$node did not start within 10 s"; }
            sleep 0.1
        done
    done
    local with="run jobs with hpc/cluster/mpirun"
    if slurm_installed; then
        start_slurm "$count"
        with+=", or under Slurm: export SLURM_CONF=$slurm/slurm.conf"
    fi
    echo "hpc/cluster: up: $(nodes | tr '\n' ' ')(node-local disks at $local_path; $with)"
}

kill_node() {
    local node="${1:-}" ns
    [[ -n "$node" ]] && grep -qx "$node" <(nodes) || die "kill takes a node of the cluster ($(nodes | tr '\n' ' '))"
    ns="mpiscale-${node}"
    # every process of the node at once (its ranks, its daemons, the holder: its tmpfs goes with its namespace)
    kill_namespace "$ns"
    echo "hpc/cluster: killed every process of $node; its node-local disk is gone"
}

down() {
    local ns link
    # every node's namespace, listed in the run directory or not (an up interrupted before it wrote the list)
    for ns in $(ip netns list | awk '$1 ~ /^mpiscale-node[0-9]+$/ {print $1}'); do
        kill_namespace "$ns" || true
        ip netns del "$ns"
    done
    stop_slurm
    # the machine's ends of the nodes' links (gone with their namespaces, unless something else still holds one)
    for link in $(ip -o link show | awk -F': ' '$2 ~ /^mpiscale-v[0-9]+@/ {sub(/@.*/, "", $2); print $2}'); do
        ip link del "$link"
    done
    ip link show "$bridge" >/dev/null 2>&1 && ip link del "$bridge"
    sed -i "/ $tag\$/d" /etc/hosts
    [[ -f "$run/made-local-path" ]] && rmdir "$local_path" 2>/dev/null || true
    rm -rf "$run"
    echo "hpc/cluster: down"
}

status() {
    [[ -f "$run/nodes" ]] || { echo "hpc/cluster: not up"; return 1; }
    local node state
    for node in $(nodes); do
        state=down
        holder_alive "$node" && state=up
        echo "$node $(awk -v n="$node" '$2 == n {print $1}' /etc/hosts) $state"
    done
}

# One command at a time on the machine's cluster: two ups at once would each start daemons and holders over the
# other's (a second test session, a second terminal), leaving some that no pid file names. The script runs again
# under flock, which holds the lock until it ends; -o keeps the lock's descriptor from the script, so the holders and
# daemons it leaves running do not hold the lock for ever.
if [[ "${1:-}" =~ ^(up|down|kill)$ && -z "${MPISCALE_CLUSTER_LOCKED:-}" ]]; then
    [[ "$(id -u)" == 0 ]] || die "must run as root (it makes network, UTS and mount namespaces, a bridge and mounts)"
    status=0
    MPISCALE_CLUSTER_LOCKED=1 flock -o -w 300 -E 75 /run/mpiscale-cluster.lock "$0" "$@" || status=$?
    ((status != 75)) || die "another hpc/cluster/cluster.sh command has held the cluster for 300 s"
    exit "$status"
fi

case "${1:-}" in
    up) up "${2-3}" ;;  # none given: 3; an empty one is refused
    down) down ;;
    status) status ;;
    kill) kill_node "${2:-}" ;;
    *) sed -n '2,6p' "$0" >&2; exit 2 ;;
esac
