# Brings the release's shared pools in line with the chart. The <release>-pools-r<revision> Job submits this as a
# Ray job, so it runs on the Ray head and the pools' manager actor (which its driver owns) is placed there, not on a
# pod that goes away. Once per Helm revision (templates/pools-job.yaml):
#
#   sh reconcile-pools.sh <tandem pools start flags, without --name>
#   env: TANDEM_POOLS          the pools' name
#        TANDEM_IMAGE          the release's image: `tandem pools start` records it, gateways compare theirs with it
#        TANDEM_RAY_SPEC_WANT  the RayCluster fingerprint this release renders ("" to skip the check); the head's
#                              own TANDEM_RAY_SPEC must equal it (under upgradeStrategy Recreate, KubeRay may not have
#                              replaced the old head yet: fail, and the Job retries)
#
# No pools of that name: start them. Pools of another image, target or draft model or tp: stop them and start them anew
# (the upgrade path; gateways of the old image then refuse the new pools and are replaced by the rollout). Same image
# and models: scale draft and target to the flags' counts. Other flags (--kv-tokens, --k-max, ...) take effect when
# the pools are next started: `tandem pools stop --name <pools>` and re-run the Job (README.md, "Upgrades").
set -eu
name=$TANDEM_POOLS
image=$TANDEM_IMAGE
log() { echo "reconcile-pools: $*"; }

# One reconcile at a time on this head: a retried Job pod may find an earlier Ray job still at work.
exec 9>"/tmp/tandem-pools-$name.lock"
if command -v flock >/dev/null 2>&1; then flock 9; fi

if [ -n "${TANDEM_RAY_SPEC_WANT:-}" ] && [ "${TANDEM_RAY_SPEC:-}" != "$TANDEM_RAY_SPEC_WANT" ]; then
    log "this Ray head runs RayCluster spec ${TANDEM_RAY_SPEC:-unknown}, the release renders $TANDEM_RAY_SPEC_WANT:" \
        "KubeRay has not replaced the cluster yet (upgradeStrategy Recreate); failing so that the Job retries" >&2
    exit 1
fi

# The models and sizes the flags ask for (argparse keeps the last of a repeated flag, and so does this).
target="" draft="" drafts=1 targets=1 tp=1 spec=1 previous=""
for arg in "$@"; do
    case $previous in
        --target) target=$arg ;;
        --draft) draft=$arg ;;
        --draft-workers) drafts=$arg ;;
        --target-replicas) targets=$arg ;;
        --tp) tp=$arg ;;
    esac
    case $arg in
        --target=*) target=${arg#*=} ;;
        --draft=*) draft=${arg#*=} ;;
        --draft-workers=*) drafts=${arg#*=} ;;
        --target-replicas=*) targets=${arg#*=} ;;
        --tp=*) tp=${arg#*=} ;;
        --no-spec) spec="" ;;
    esac
    previous=$arg
done
if [ -z "$spec" ] || [ "$drafts" = 0 ]; then draft=""; fi  # the pools then report no draft model

start() {
    log "starting pools $name: image $image, target $target, draft ${draft:-none}"
    exec tandem pools start --name "$name" "$@"
}

if ! status=$(tandem pools status --name "$name" --json); then
    start "$@"
fi

# status: a JSON object on its last line starting with "{"; field KEY prints one of its top-level strings, workers
# ROLE counts that role's workers.
query() {
    printf '%s\n' "$status" | python3 -c 'import json, sys
status = json.loads([line for line in sys.stdin if line.startswith("{")][-1])
if sys.argv[1] == "field":
    print(status.get(sys.argv[2]) or "")
else:
    print(sum(w.get("role") == sys.argv[2] for w in status.get("workers", [])))' "$@"
}
field() { query field "$1"; }
workers() { query workers "$1"; }
have_image=$(field image)
have_target=$(field target)
have_draft=$(field draft)
have_tp=$(field tensor_parallel)
if [ "$have_image" != "$image" ] || [ "$have_target" != "$target" ] || [ "$have_draft" != "$draft" ] \
        || [ "${have_tp:-1}" != "$tp" ]; then
    log "pools $name run image ${have_image:-unknown}, target $have_target (tp ${have_tp:-1}), draft" \
        "${have_draft:-none}; the release wants image $image, target $target (tp $tp), draft ${draft:-none}:" \
        "stopping them"
    tandem pools stop --name "$name"
    start "$@"
fi

for role in target draft; do
    if [ "$role" = target ]; then want=$targets; else want=$drafts; fi
    if [ "$role" = draft ] && [ -z "$draft" ]; then continue; fi
    have=$(workers "$role")
    if [ "$have" != "$want" ]; then
        log "pools $name: scaling $role from $have to $want"
        tandem pools scale --name "$name" "$role" "$want"
    fi
done
log "pools $name are up to date: image $image, target $target, draft ${draft:-none}, $targets target, $drafts draft"
