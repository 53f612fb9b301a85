{{/* Names. Kubernetes names are at most 63 characters; fullname leaves room for the suffixes below. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* KubeRay names the head Service <RayCluster>-head-svc and shortens names over 50 characters: stay below. */}}
{{- define "tandem.rayClusterName" -}}
{{- printf "%s-ray" (include "tandem.fullname" . | trunc 37 | trimSuffix "-") }}
{{- end }}

{{- define "tandem.redisName" -}}
{{- printf "%s-redis" (include "tandem.fullname" .) }}
{{- end }}

{{/* Labels: call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" .ctx }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end }}

{{/* The one image of every pod: (dict "ctx" $). Gateways and Ray workers must run the same tandem and Ray. */}}
{{- define "tandem.image" -}}
{{- printf "%s:%s" .ctx.Values.image.repository (.ctx.Values.image.tag | default .ctx.Chart.AppVersion) }}
{{- end }}

{{/*
The Ray resource that pins pool workers to this image: every Ray worker pod advertises it (1000 units) and every
draft worker and target rank asks for one, so a worker never starts on a pod of another image (an older pod the
cluster has not replaced yet): it waits for a pod of its own image instead.
*/}}
{{- define "tandem.imageResource" -}}
{{- printf "tandem_image_%s" (include "tandem.image" (dict "ctx" .) | sha256sum | trunc 12) }}
{{- end }}

{{/* The release's shared pools' name (`tandem pools start --name`, `tandem gateway --pools`): [A-Za-z0-9-]. */}}
{{- define "tandem.poolsName" -}}
{{- include "tandem.fullname" . | replace "." "-" }}
{{- end }}

{{/* Tensor-parallel ranks per target replica: pools.tp for shared pools, serving.tp for embedded gateways. */}}
{{- define "tandem.tp" -}}
{{- ternary .Values.pools.tp .Values.serving.tp (eq .Values.topology "pools") }}
{{- end }}

{{/* Ray resources each actor of a pool asks for: (dict "ctx" $ "pool" "draft"|"target"), as JSON. */}}
{{- define "tandem.actorResources" -}}
{{- $pool := ternary .ctx.Values.ray.draftPool .ctx.Values.ray.targetPool (eq .pool "draft") }}
{{- dict $pool.customResource 1 (include "tandem.imageResource" .ctx) 1 | toJson }}
{{- end }}

{{/* Ray GCS address the gateway attaches to. */}}
{{- define "tandem.rayAddress" -}}
{{- .Values.ray.address | default (printf "%s-head-svc:6379" (include "tandem.rayClusterName" .)) }}
{{- end }}

{{/*
The gateway's OpenAI-compatible HTTP port (--http-port, container port http), or "" when it is off: gateway.httpPort
null or 0, or gateway.http.enabled false.
*/}}
{{- define "tandem.httpPort" -}}
{{- $g := .Values.gateway }}
{{- if and (dig "http" "enabled" true $g) $g.httpPort }}{{ int $g.httpPort }}{{ end }}
{{- end }}

{{/* The gateway Services' http port, when the HTTP API is on: gateway.service.httpPort, else gateway.httpPort. */}}
{{- define "tandem.serviceHttpPort" -}}
{{- with include "tandem.httpPort" . }}{{ int ($.Values.gateway.service.httpPort | default .) }}{{ end }}
{{- end }}

{{/*
REDIS_URL for the gateway: the bundled StatefulSet's headless Service, or the external URL. The bundled Redis needs
its password: TANDEM_REDIS_PASSWORD from its Secret, which tandem folds into the URL (URL-quoted, so any password
works; tandem refuses a password given both there and in the URL), so neither the pod spec nor a command line holds
it.
*/}}
{{- define "tandem.redisEnv" -}}
{{- if .Values.redis.bundled.enabled }}
- name: TANDEM_REDIS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ include "tandem.redisSecretName" . }}, key: {{ .Values.redis.auth.key | quote }}}
{{- end }}
- name: REDIS_URL
{{- if .Values.redis.bundled.enabled }}
  value: {{ printf "redis://%s:6379/0" (include "tandem.redisName" .) | quote }}
{{- else if .Values.redis.existingSecret.name }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret.name }}
      key: {{ .Values.redis.existingSecret.key }}
{{- else }}
  value: {{ .Values.redis.url | quote }}
{{- end }}
{{- end }}

{{/*
Gateway arms as a YAML list: gatewayArms with defaults filled in, or one unnamed arm for a single gateway.
Each: name, suffix ("" or "-<name>"), weight, draftModel, replicas, minReplicas, maxReplicas, extraArgs.
*/}}
{{- define "tandem.gatewayArms" -}}
{{- $g := .Values.gateway }}
{{- $arms := list }}
{{- range $item := .Values.gatewayArms }}
{{- $arm := dict "name" .name "suffix" (printf "-%s" .name) "weight" .weight
    "draftModel" (.draftModel | default $.Values.models.draft) "extraArgs" (.extraArgs | default list) }}
{{- range $key := list "replicas" "minReplicas" "maxReplicas" }}
{{- $default := ternary $g.replicas (get $g.autoscaling $key) (eq $key "replicas") }}
{{- $set := and (hasKey $item $key) (not (kindIs "invalid" (index $item $key))) }}
{{- $_ := set $arm $key (ternary (index $item $key | default 0) $default $set) }}
{{- end }}
{{- $arms = append $arms $arm }}
{{- else }}
{{- $arms = append $arms (dict "name" "" "suffix" "" "weight" 100 "draftModel" .Values.models.draft "extraArgs" list
    "replicas" $g.replicas "minReplicas" $g.autoscaling.minReplicas "maxReplicas" $g.autoscaling.maxReplicas) }}
{{- end }}
{{- toYaml $arms }}
{{- end }}

{{/*
Gateway replicas over all arms: {static, min, max}. With the HPA on, static (the size of pools that do not
autoscale) is the most the HPAs can reach, so every gateway they add finds its workers.
*/}}
{{- define "tandem.gatewayCounts" -}}
{{- $static := 0 }}{{ $min := 0 }}{{ $max := 0 }}
{{- range include "tandem.gatewayArms" . | fromYamlArray }}
{{- $static = add $static .replicas }}{{ $min = add $min .minReplicas }}{{ $max = add $max .maxReplicas }}
{{- end }}
{{- if .Values.gateway.autoscaling.enabled }}
{{- dict "static" $max "min" $min "max" $max | toYaml }}
{{- else }}
{{- dict "static" $static "min" $static "max" $static | toYaml }}
{{- end }}
{{- end }}

{{- define "tandem.rayAutoscaling" -}}
{{- if kindIs "invalid" .Values.ray.autoscaling.enabled }}
{{- ternary "true" "" (or (eq .Values.topology "pools") (.Values.gateway.autoscaling.enabled | default false)) }}
{{- else }}
{{- ternary "true" "" .Values.ray.autoscaling.enabled }}
{{- end }}
{{- end }}

{{/*
Worker-group sizes {replicas, min, max} for (dict "ctx" $ "pool" "draft"|"target"), packed workersPerPod draft
workers or one target replica per pod. topology=pools: the pools' declared size (static, min) and the most
`tandem pools scale` may reach (max). embedded: gateways x actors each needs. An explicit pool.replicas pins all three.
*/}}
{{- define "tandem.poolSize" -}}
{{- $v := .ctx.Values }}
{{- $isDraft := eq .pool "draft" }}
{{- $pool := ternary $v.ray.draftPool $v.ray.targetPool $isDraft }}
{{- $perPod := ternary $v.ray.draftPool.workersPerPod 1 $isDraft }}
{{- if not (kindIs "invalid" $pool.replicas) }}
{{- dict "replicas" $pool.replicas "min" $pool.replicas "max" $pool.replicas | toYaml }}
{{- else }}
{{- $actors := dict }}
{{- if eq $v.topology "pools" }}
{{- $declared := ternary $v.pools.draftWorkers $v.pools.targetReplicas $isDraft }}
{{- $most := ternary $v.pools.maxDraftWorkers $v.pools.maxTargetReplicas $isDraft }}
{{- $actors = dict "static" $declared "min" $declared "max" (ternary $most 0 (gt (int $declared) 0)) }}
{{- else }}
{{- $counts := include "tandem.gatewayCounts" .ctx | fromYaml }}
{{- $perGateway := ternary $v.serving.draftWorkers $v.serving.targetReplicas $isDraft }}
{{- range $key := list "static" "min" "max" }}
{{- $_ := set $actors $key (mul (get $counts $key) $perGateway) }}
{{- end }}
{{- end }}
{{- $sizes := dict }}
{{- range $key := list "static" "min" "max" }}
{{- $_ := set $sizes $key (div (add (get $actors $key) (sub $perPod 1)) $perPod) }}
{{- end }}
{{- if include "tandem.rayAutoscaling" .ctx }}
{{- dict "replicas" $sizes.min "min" $sizes.min "max" $sizes.max | toYaml }}
{{- else }}
{{- dict "replicas" $sizes.static "min" $sizes.static "max" $sizes.static | toYaml }}
{{- end }}
{{- end }}
{{- end }}

{{/* GPUs per draft worker: gpusPerPod / workersPerPod, as `--draft-gpus` takes it. */}}
{{- define "tandem.draftGpusPerWorker" -}}
{{- $p := .Values.ray.draftPool }}
{{- if $p.gpusPerPod }}{{ divf $p.gpusPerPod $p.workersPerPod }}{{ else }}0{{ end }}
{{- end }}

{{/* The Secret holding the bundled Redis' password: redis.auth.existingSecret, else the chart's own. */}}
{{- define "tandem.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (printf "%s-redis-auth" (include "tandem.fullname" .)) }}
{{- end }}

{{/* The Secret holding the Ray token: ray.auth.existingSecret, else the chart's own. */}}
{{- define "tandem.raySecretName" -}}
{{- .Values.ray.auth.existingSecret | default (printf "%s-ray-auth" (include "tandem.fullname" .)) }}
{{- end }}

{{- define "tandem.canarySecretName" -}}
{{- .Values.canary.secret.existingSecret | default (printf "%s-canary-secret" (include "tandem.fullname" .)) }}
{{- end }}

{{/*
A generated Secret's value, base64: (dict "ctx" $ "name" SECRET "key" KEY). The value the Secret already holds in the
cluster (so an upgrade keeps the password or token every running pod uses), else a new random one. `helm template`
and --dry-run cannot look it up and print a new one each time.
*/}}
{{- define "tandem.secretValue" -}}
{{- $existing := lookup "v1" "Secret" .ctx.Release.Namespace .name | default dict }}
{{- dig "data" .key "" $existing | default (randAlphaNum 40 | b64enc) }}
{{- end }}

{{/* Ray token authentication for a container that talks to the Ray cluster (Ray >= 2.52). */}}
{{- define "tandem.rayAuthEnv" -}}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ include "tandem.raySecretName" . }}, key: {{ .Values.ray.auth.key | quote }}}
{{- end }}

{{/*
Writable scratch for a tandem-image container whose root filesystem is read-only: /tmp (Ray's session directory
/tmp/ray, Python's tempfiles, torch's compile caches) and HOME (~/.cache for Hugging Face and pip, ~/.triton, ~/.nv).
HOME is set explicitly so it does not depend on the image's passwd entry.
*/}}
{{- define "tandem.homeDir" -}}/home/tandem{{- end }}

{{- define "tandem.scratchEnv" -}}
- name: HOME
  value: {{ include "tandem.homeDir" . }}
{{- end }}

{{- define "tandem.scratchMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: home, mountPath: {{ include "tandem.homeDir" . }}}
{{- end }}

{{- define "tandem.scratchVolumes" -}}
- {name: tmp, emptyDir: {}}
- {name: home, emptyDir: {}}
{{- end }}

{{/*
Gateway TLS as {secretName, clientCA, clientCASecret, clientCAKey}: secretName "" when TLS is off. secretName is
gateway.tls.secretName, else <fullname>-gateway-tls when the chart's cert-manager Certificate writes it.
*/}}
{{- define "tandem.gatewayTLS" -}}
{{- $tls := .Values.gateway.tls }}
{{- $secret := $tls.secretName }}
{{- if and (not $secret) $tls.certManager.issuerRef.name }}
{{- $secret = printf "%s-gateway-tls" (include "tandem.fullname" .) }}
{{- end }}
{{- $clientCA := and $secret $tls.clientCA.enabled }}
{{- dict "secretName" $secret "clientCA" $clientCA "clientCASecret" ($tls.clientCA.secretName | default $secret)
    "clientCAKey" $tls.clientCA.key | toYaml }}
{{- end }}

{{- define "tandem.tlsDir" -}}/etc/tandem/tls{{- end }}
{{- define "tandem.clientCADir" -}}/etc/tandem/client-ca{{- end }}

{{/* --tls-cert/--tls-key (and --tls-client-ca) from the mounted Secrets, or nothing in plaintext. */}}
{{- define "tandem.gatewayTLSArgs" -}}
{{- $tls := include "tandem.gatewayTLS" . | fromYaml }}
{{- $args := list }}
{{- if $tls.secretName }}
{{- $dir := include "tandem.tlsDir" . }}
{{- $args = list (printf "--tls-cert=%s/tls.crt" $dir) (printf "--tls-key=%s/tls.key" $dir) }}
{{- if $tls.clientCA }}
{{- $caDir := ternary (include "tandem.tlsDir" .) (include "tandem.clientCADir" .) (eq $tls.clientCASecret $tls.secretName) }}
{{- $args = append $args (printf "--tls-client-ca=%s/%s" $caDir $tls.clientCAKey) }}
{{- end }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{/*
The gateway's readiness (and startup) check under TLS. Kubernetes' gRPC probes cannot speak TLS and its HTTPS probes
present no client certificate, so: plain TLS, an httpGet of /health over HTTPS (the kubelet does not verify the
certificate); mutual TLS, an exec of Python's ssl client presenting the gateway's own certificate. /health answers
503 while loading or draining, as the gRPC health service reports NOT_SERVING.
*/}}
{{- define "tandem.gatewayTLSCheck" -}}
{{- $tls := include "tandem.gatewayTLS" . | fromYaml }}
{{- if $tls.clientCA }}
exec:
  command:
    - python3
    - -c
    - |
      import http.client, ssl, sys
      port, cert, key = sys.argv[1:4]
      context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
      context.check_hostname = False
      context.verify_mode = ssl.CERT_NONE  # the probe checks health, not the gateway's identity
      context.load_cert_chain(cert, key)
      connection = http.client.HTTPSConnection("127.0.0.1", int(port), context=context, timeout=4)
      connection.request("GET", "/health")
      sys.exit(connection.getresponse().status != 200)
    - {{ include "tandem.httpPort" . | quote }}
    - {{ include "tandem.tlsDir" . }}/tls.crt
    - {{ include "tandem.tlsDir" . }}/tls.key
{{- else }}
httpGet: {path: /health, port: http, scheme: HTTPS}
{{- end }}
{{- end }}

{{/* Checks the JSON schema cannot express. Rendered (empty) by the gateway Deployment. */}}
{{- define "tandem.validate" -}}
{{- $v := .Values }}
{{- $tls := include "tandem.gatewayTLS" . | fromYaml }}
{{- if and $tls.secretName (not (include "tandem.httpPort" .)) }}
{{- fail "gateway.tls: the gateway's probes need the HTTP API under TLS (Kubernetes' gRPC probes cannot speak TLS; they check /health over HTTPS instead); set gateway.httpPort and gateway.http.enabled=true" }}
{{- end }}
{{- if and $v.gateway.tls.clientCA.enabled (not $tls.secretName) }}
{{- fail "gateway.tls.clientCA.enabled: mutual TLS needs TLS; set gateway.tls.secretName (or gateway.tls.certManager.issuerRef.name)" }}
{{- end }}
{{- if and $v.redis.auth.existingSecret (not $v.redis.bundled.enabled) }}
{{- fail "redis.auth.existingSecret: the password is the bundled Redis'; an external Redis takes its password in its URL (redis.existingSecret)" }}
{{- end }}
{{- $dashboardHost := toString (dig "dashboard-host" "127.0.0.1" $v.ray.head.rayStartParams) }}
{{- if not (has $dashboardHost (list "127.0.0.1" "localhost")) }}
{{- fail (printf "ray.head.rayStartParams.dashboard-host %s: the Ray dashboard accepts jobs (code execution) and stays on the head's loopback; the pools Job reaches it from inside the head (README.md, \"Ray: the dashboard and the token\")" $dashboardHost) }}
{{- end }}
{{- if and (not $v.gateway.joinRayCluster) (not (hasPrefix "ray://" (toString $v.ray.address))) }}
{{- fail (printf "gateway.joinRayCluster false: with no Ray node of its own in the pod the gateway joins as a Ray Client, so ray.address must be the head's client URL, e.g. ray://%s-head-svc:10001 (a GCS address needs a raylet beside the driver)" (include "tandem.rayClusterName" .)) }}
{{- end }}
{{- if semverCompare "<2.52.0-0" $v.ray.version }}
{{- fail (printf "ray.version %s: Ray token authentication (RAY_AUTH_MODE=token, which the chart always sets) needs Ray >= 2.52; use an image with a newer Ray" $v.ray.version) }}
{{- end }}
{{- if and $v.redis.bundled.enabled (or $v.redis.url $v.redis.existingSecret.name) }}
{{- fail "redis: set either redis.url / redis.existingSecret.name (external) or redis.bundled.enabled, not both" }}
{{- end }}
{{- if not (or $v.redis.bundled.enabled $v.redis.url $v.redis.existingSecret.name) }}
{{- fail "redis: set redis.url, redis.existingSecret.name or redis.bundled.enabled=true (gateway replicas share session state)" }}
{{- end }}
{{- if $v.canary.enabled }}
{{- if not $v.canary.arms }}{{ fail "canary.arms: list at least one arm when canary.enabled" }}{{ end }}
{{- $sum := 0 }}{{ $names := dict }}
{{- range $v.canary.arms }}{{ $sum = add $sum .weight }}{{ $_ := set $names .name true }}{{ end }}
{{- if ne (int $sum) 100 }}{{ fail (printf "canary.arms: weights must sum to 100, got %d" (int $sum)) }}{{ end }}
{{- if ne (len $names) (len $v.canary.arms) }}{{ fail "canary.arms: arm names must be unique" }}{{ end }}
{{- end }}
{{- if $v.gatewayArms }}
{{- $sum := 0 }}{{ $names := dict }}
{{- range $v.gatewayArms }}{{ $sum = add $sum .weight }}{{ $_ := set $names .name true }}{{ end }}
{{- if ne (int $sum) 100 }}{{ fail (printf "gatewayArms: weights must sum to 100, got %d" (int $sum)) }}{{ end }}
{{- if ne (len $names) (len $v.gatewayArms) }}{{ fail "gatewayArms: arm names must be unique" }}{{ end }}
{{- end }}
{{- if $v.gateway.autoscaling.enabled }}
{{- range include "tandem.gatewayArms" . | fromYamlArray }}
{{- if gt (int .minReplicas) (int .maxReplicas) }}
{{- fail (printf "gateway%s autoscaling: minReplicas %d exceeds maxReplicas %d" .suffix (int .minReplicas) (int .maxReplicas)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and $v.gatewayApi.grpcRoute.enabled (not $v.gatewayApi.grpcRoute.parentRefs) }}
{{- fail "gatewayApi.grpcRoute.parentRefs: name the Gateway the GRPCRoute attaches to" }}
{{- end }}
{{- $http := include "tandem.httpPort" . }}
{{- if $http }}
{{- range $name, $port := dict "grpcPort" $v.gateway.grpcPort "metricsPort" $v.gateway.metricsPort }}
{{- if eq (int $port) (int $http) }}
{{- fail (printf "gateway.httpPort %s: gateway.%s takes it; pick another" $http $name) }}
{{- end }}
{{- end }}
{{- if eq (int (include "tandem.serviceHttpPort" .)) (int $v.gateway.service.port) }}
{{- fail (printf "gateway.service.httpPort: the Service's http port %s is also its grpc port (gateway.service.port); set gateway.service.httpPort to another" (include "tandem.serviceHttpPort" .)) }}
{{- end }}
{{- end }}
{{- if $v.gatewayApi.httpRoute.enabled }}
{{- if not $http }}
{{- fail "gatewayApi.httpRoute.enabled: the HTTPRoute needs the gateway's HTTP API; set gateway.httpPort and gateway.http.enabled=true" }}
{{- end }}
{{- if not $v.gatewayApi.httpRoute.parentRefs }}
{{- fail "gatewayApi.httpRoute.parentRefs: name the Gateway the HTTPRoute attaches to" }}
{{- end }}
{{- end }}
{{- if eq $v.topology "pools" }}
{{- if gt (int $v.serving.tp) 1 }}
{{- fail (printf "serving.tp=%d: serving.* sizes topology=embedded gateways; shared pools take pools.tp" (int $v.serving.tp)) }}
{{- end }}
{{- if $v.canary.enabled }}
{{- fail "canary.enabled: the in-gateway canary switches draft models per session, and shared pools serve one draft model; set topology=embedded, or use gatewayArms for gateway-flag canaries" }}
{{- end }}
{{- range $v.gatewayArms }}
{{- if and .draftModel (ne .draftModel $v.models.draft) }}
{{- fail (printf "gatewayArms[%s].draftModel: with topology=pools every arm attaches to the same pools (draft %s); set topology=embedded for per-arm draft models" .name $v.models.draft) }}
{{- end }}
{{- end }}
{{- if $v.serving.extraArgs }}
{{- fail "serving.extraArgs: `tandem serve` flags apply to topology=embedded; with topology=pools use pools.extraArgs (tandem pools start) and gateway.extraArgs (tandem gateway)" }}
{{- end }}
{{- if lt (int $v.pools.maxDraftWorkers) (int $v.pools.draftWorkers) }}
{{- fail (printf "pools.maxDraftWorkers %d is below pools.draftWorkers %d" (int $v.pools.maxDraftWorkers) (int $v.pools.draftWorkers)) }}
{{- end }}
{{- if lt (int $v.pools.maxTargetReplicas) (int $v.pools.targetReplicas) }}
{{- fail (printf "pools.maxTargetReplicas %d is below pools.targetReplicas %d" (int $v.pools.maxTargetReplicas) (int $v.pools.targetReplicas)) }}
{{- end }}
{{- end }}
{{- $ft := include "tandem.gcsFaultTolerance" . | fromYaml }}
{{- if and $ft.enabled (not $ft.address) }}
{{- fail "ray.gcsFaultTolerance: set ray.gcsFaultTolerance.redisAddress (host:port of the Redis that keeps the GCS tables); it cannot be read from redis.existingSecret or a URL with a password" }}
{{- end }}
{{- $first := int $v.ray.workerMetricsPort }}
{{- $last := int (sub (add $first (int (include "tandem.workersPerPod" (dict "ctx" . "pool" "max")))) 1) }}
{{- $exporter := int $v.ray.metricsPort }}
{{- if and (ge $exporter $first) (le $exporter $last) }}
{{- fail (printf "ray.workerMetricsPort: the workers of a pod serve /metrics on ports %d-%d, which takes ray.metricsPort %d (Ray's own exporter on the same pod); pick another" $first $last $exporter) }}
{{- end }}
{{- end }}

{{/*
GCS fault tolerance as {enabled, address}: on by default with the bundled Redis; the address is redisAddress, else
the bundled Redis, else the host of a password-less redis:// redis.url.
*/}}
{{- define "tandem.gcsFaultTolerance" -}}
{{- $v := .Values }}
{{- $ft := $v.ray.gcsFaultTolerance }}
{{- $address := $ft.redisAddress }}
{{- if not $address }}
{{- if $v.redis.bundled.enabled }}
{{- $address = printf "%s:6379" (include "tandem.redisName" .) }}
{{- else if hasPrefix "redis://" $v.redis.url }}
{{- $url := urlParse $v.redis.url }}
{{- if not $url.userinfo }}
{{- $address = ternary $url.host (printf "%s:6379" $url.host) (contains ":" $url.host) }}
{{- end }}
{{- end }}
{{- end }}
{{- $enabled := ternary $v.redis.bundled.enabled $ft.enabled (kindIs "invalid" $ft.enabled) }}
{{- dict "enabled" $enabled "address" $address | toYaml }}
{{- end }}

{{/*
Worker actors per pod of a group: (dict "ctx" $ "pool" "draft"|"target"|"max"): the draft pool's workersPerPod, the
target pool's tp ranks, or the larger. Each serves /metrics on its own port from ray.workerMetricsPort.
*/}}
{{- define "tandem.workersPerPod" -}}
{{- $draft := int .ctx.Values.ray.draftPool.workersPerPod }}
{{- $target := int (include "tandem.tp" .ctx) }}
{{- if eq .pool "draft" }}{{ $draft }}{{ else if eq .pool "target" }}{{ $target }}{{ else }}{{ max $draft $target }}{{ end }}
{{- end }}

{{/*
--device for the Ray workers (on `tandem pools start`, or on `tandem serve` with topology=embedded; the gateway
itself loads no model; the flag reaches every draft worker and target rank). cuda when every pool that gets actors
requests GPUs: a GPU pod whose CUDA does not work then fails with the reason instead of decoding on its CPU. cpu when
none does. auto when only one of two does (one flag serves both pools): each worker takes what Ray gives it, its GPU
or CUDA_VISIBLE_DEVICES="" (quietly cpu), and warns when its GPU is unusable.
*/}}
{{- define "tandem.workerDevice" -}}
{{- $v := .Values }}
{{- $targetGpus := gt (int (mul (include "tandem.tp" .) $v.ray.targetPool.gpusPerRank)) 0 }}
{{- $draftGpus := gt (int $v.ray.draftPool.gpusPerPod) 0 }}
{{- $draftWorkers := ternary $v.pools.draftWorkers $v.serving.draftWorkers (eq $v.topology "pools") }}
{{- $drafting := gt (int $draftWorkers) 0 }}
{{- if and $targetGpus (or $draftGpus (not $drafting)) }}cuda
{{- else if not (or $targetGpus (and $drafting $draftGpus)) }}cpu
{{- else }}auto
{{- end }}
{{- end }}

{{/* `tandem serve` arguments for one gateway arm: (dict "ctx" $ "arm" $arm). */}}
{{- define "tandem.serveArgs" -}}
{{- $v := .ctx.Values }}
{{- $s := $v.serving }}
{{- $args := list "serve" "--host=0.0.0.0"
    (printf "--port=%v" $v.gateway.grpcPort)
    (printf "--http-port=%s" (include "tandem.httpPort" .ctx | default "-1"))
    (printf "--metrics-port=%v" $v.gateway.metricsPort)
    (printf "--ray-address=%s" (include "tandem.rayAddress" .ctx))
    (printf "--target=%s" $v.models.target)
    (printf "--draft=%s" .arm.draftModel)
    (printf "--draft-workers=%v" $s.draftWorkers)
    (printf "--target-replicas=%v" $s.targetReplicas)
    (printf "--tp=%v" $s.tp)
    (printf "--draft-gpus=%s" (include "tandem.draftGpusPerWorker" .ctx))
    (printf "--target-gpus=%v" $v.ray.targetPool.gpusPerRank)
    (printf "--draft-resources=%s" (include "tandem.actorResources" (dict "ctx" .ctx "pool" "draft")))
    (printf "--target-resources=%s" (include "tandem.actorResources" (dict "ctx" .ctx "pool" "target")))
    (printf "--grace=%v" $v.gateway.grace)
    (printf "--device=%s" (include "tandem.workerDevice" .ctx)) }}
{{- toYaml (concat $args (include "tandem.gatewayAuthArgs" .ctx | fromYamlArray)
    (include "tandem.httpApiArgs" .ctx | fromYamlArray) (include "tandem.gatewayTLSArgs" .ctx | fromYamlArray)
    $s.extraArgs $v.gateway.extraArgs .arm.extraArgs) }}
{{- end }}

{{/* --api-keys from gateway.apiKeys.secretName (mounted at tandem.apiKeysDir), else --insecure: the gateway listens on
0.0.0.0, which `tandem serve`/`tandem gateway` refuse without keys unless told. */}}
{{- define "tandem.gatewayAuthArgs" -}}
{{- $keys := .Values.gateway.apiKeys }}
{{- if $keys.secretName }}
{{- toYaml (list (printf "--api-keys=%s/%s" (include "tandem.apiKeysDir" .) $keys.key)) }}
{{- else }}
{{- toYaml (list "--insecure") }}
{{- end }}
{{- end }}

{{/* --response-ttl, --allowed-origins and --http-keep-alive from gateway.http, while the HTTP API is on (they are the
API's alone). */}}
{{- define "tandem.httpApiArgs" -}}
{{- $ttl := dig "http" "responseTtlSeconds" nil .Values.gateway }}
{{- $keepAlive := dig "http" "keepAliveSeconds" nil .Values.gateway }}
{{- $origins := dig "http" "allowedOrigins" list .Values.gateway }}
{{- $args := list }}
{{- if include "tandem.httpPort" . }}
{{- if not (kindIs "invalid" $ttl) }}{{ $args = append $args (printf "--response-ttl=%v" $ttl) }}{{ end }}
{{- if $origins }}{{ $args = append $args (printf "--allowed-origins=%s" (join "," $origins)) }}{{ end }}
{{- if not (kindIs "invalid" $keepAlive) }}{{ $args = append $args (printf "--http-keep-alive=%v" $keepAlive) }}{{ end }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{- define "tandem.apiKeysDir" -}}/etc/tandem/api-keys{{- end }}

{{/* `tandem gateway` arguments for one gateway arm over the release's pools: (dict "ctx" $ "arm" $arm). */}}
{{- define "tandem.gatewayArgs" -}}
{{- $v := .ctx.Values }}
{{- $args := list "gateway"
    (printf "--pools=%s" (include "tandem.poolsName" .ctx))
    "--host=0.0.0.0"
    (printf "--port=%v" $v.gateway.grpcPort)
    (printf "--http-port=%s" (include "tandem.httpPort" .ctx | default "-1"))
    (printf "--metrics-port=%v" $v.gateway.metricsPort)
    (printf "--ray-address=%s" (include "tandem.rayAddress" .ctx))
    (printf "--grace=%v" $v.gateway.grace) }}
{{- toYaml (concat $args (include "tandem.gatewayAuthArgs" .ctx | fromYamlArray)
    (include "tandem.httpApiArgs" .ctx | fromYamlArray) (include "tandem.gatewayTLSArgs" .ctx | fromYamlArray)
    $v.gateway.extraArgs .arm.extraArgs) }}
{{- end }}

{{/*
`tandem pools start` flags (--name comes from the Job's TANDEM_POOLS; --ray-address from the Ray job's RAY_ADDRESS).
Each draft worker and target rank asks for its pool's resource and the image's (tandem.imageResource).
*/}}
{{- define "tandem.poolsStartArgs" -}}
{{- $v := .Values }}
{{- $args := list
    (printf "--target=%s" $v.models.target)
    (printf "--draft=%s" $v.models.draft)
    (printf "--draft-workers=%v" $v.pools.draftWorkers)
    (printf "--target-replicas=%v" $v.pools.targetReplicas)
    (printf "--tp=%v" $v.pools.tp)
    (printf "--draft-gpus=%s" (include "tandem.draftGpusPerWorker" .))
    (printf "--target-gpus=%v" $v.ray.targetPool.gpusPerRank)
    (printf "--draft-resources=%s" (include "tandem.actorResources" (dict "ctx" . "pool" "draft")))
    (printf "--target-resources=%s" (include "tandem.actorResources" (dict "ctx" . "pool" "target")))
    (printf "--device=%s" (include "tandem.workerDevice" .)) }}
{{- toYaml (concat $args $v.pools.extraArgs) }}
{{- end }}

{{/* The model cache (TANDEM_HOME) volume, named model-cache. */}}
{{- define "tandem.modelCacheVolume" -}}
- name: model-cache
{{- if .Values.models.cache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.models.cache.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.models.cache.sizeLimit }}
{{- end }}
{{- end }}

{{/* rayStartParams: KubeRay wants every value as a string (single-quoted, as in KubeRay's examples). */}}
{{- define "tandem.rayStartParams" -}}
{{- range $key, $value := . }}
{{- $s := toString $value }}
{{ $key }}: {{ ternary (toJson $s) (squote $s) (contains "'" $s) }}
{{- end }}
{{- end }}

{{/*
Pod template of a Ray node: (dict "ctx" $ "group" "head"|groupName "container" name "spec" poolValues "gpus" N
"workers" N "fingerprint" F). KubeRay fills in the container's command (ray start) and its own probes. A worker
group's pods host `workers` actors, each serving /metrics on its own port from ray.workerMetricsPort (named
wrk-metrics-<i>, which the PodMonitor scrapes). The head carries the RayCluster's fingerprint (tandem.rayFingerprint)
for the pools Job to check that it talks to a head of the current spec.
Pod Security "restricted" (ray.podSecurityContext, ray.securityContext): KubeRay copies the container's
securityContext, env and mounts into the wait-gcs-ready init container it adds to worker pods, so that one complies
and carries the Ray token too. Only the head keeps a service account token: KubeRay's autoscaler runs there.
*/}}
{{- define "tandem.rayPodTemplate" -}}
{{- $v := .ctx.Values }}
{{- $resources := deepCopy (.spec.resources | default dict) }}
{{- if gt (int .gpus) 0 }}
{{- $_ := set $resources "limits" (merge (dict $v.gpu.resourceName (int .gpus)) ($resources.limits | default dict)) }}
{{- end }}
metadata:
  labels:
    {{- include "tandem.selectorLabels" (dict "ctx" .ctx "component" "ray") | nindent 4 }}
    tandem.io/ray-group: {{ .group }}
    tandem.io/metrics: "true"
spec:
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if ne .group "head" }}
  automountServiceAccountToken: false
  {{- end }}
  {{- with $v.ray.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .container }}
      image: {{ include "tandem.image" (dict "ctx" .ctx) }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      {{- with $v.ray.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      env:
        {{- include "tandem.rayAuthEnv" .ctx | nindent 8 }}
        {{- include "tandem.scratchEnv" .ctx | nindent 8 }}
        - name: TANDEM_HOME
          value: {{ $v.models.cache.mountPath | quote }}
        - name: TOKENIZERS_PARALLELISM
          value: "false"
        - name: RAY_USAGE_STATS_ENABLED
          value: "0"
        - name: TANDEM_IMAGE
          value: {{ include "tandem.image" (dict "ctx" .ctx) | quote }}
        {{- if .workers }}
        - name: TANDEM_WORKER_METRICS_PORT
          value: {{ $v.ray.workerMetricsPort | quote }}
        {{- end }}
        {{- with .fingerprint }}
        - name: TANDEM_RAY_SPEC
          value: {{ . | quote }}
        {{- end }}
        {{- if and .workers (eq (int .gpus) 0) $v.ray.cpuPreload }}
        # A pool that decodes on its CPU: tcmalloc and Intel's OpenMP runtime for torch (ray.cpuPreload). Ray's
        # worker processes inherit it from `ray start`.
        - name: LD_PRELOAD
          value: {{ $v.ray.cpuPreload | quote }}
        {{- end }}
      ports:
        {{- if eq .group "head" }}
        # No dashboard port: the dashboard listens on the head's 127.0.0.1 only (KubeRay's head Service exposes the
        # head container's ports, so it offers none either).
        - {name: gcs-server, containerPort: 6379}
        - {name: client, containerPort: 10001}
        {{- end }}
        - {name: metrics, containerPort: {{ $v.ray.metricsPort }}}
        {{- range $i := until (int (.workers | default 0)) }}
        - {name: wrk-metrics-{{ $i }}, containerPort: {{ add $v.ray.workerMetricsPort $i }}}
        {{- end }}
      lifecycle:
        preStop:
          exec:
            command: ["/bin/sh", "-c", "ray stop"]
      resources:
        {{- toYaml $resources | nindent 8 }}
      volumeMounts:
        - name: model-cache
          mountPath: {{ $v.models.cache.mountPath }}
        - name: dshm
          mountPath: /dev/shm
        {{- include "tandem.scratchMounts" .ctx | nindent 8 }}
  volumes:
    {{- include "tandem.modelCacheVolume" .ctx | nindent 4 }}
    {{- include "tandem.scratchVolumes" .ctx | nindent 4 }}
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ .spec.shmSizeLimit | default "1Gi" }}
  {{- with .spec.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .spec.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .spec.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
