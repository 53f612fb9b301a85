{{- /*
The RayCluster's spec: (dict "ctx" $ "fingerprint" F). The head takes no actors. Draft workers and target ranks
request the custom resources draftPool.customResource / targetPool.customResource, which only their worker group
advertises, so they cannot land on each other's GPUs, and the image's resource (tandem.imageResource), which only
pods of this image advertise. One target-pool pod holds one target replica: tp ranks, tp * gpusPerRank GPUs (the
ranks' placement group is STRICT_PACK).
*/}}
{{- define "tandem.rayClusterSpec" -}}
{{- $ctx := .ctx }}
{{- $v := $ctx.Values }}
{{- $draft := $v.ray.draftPool }}
{{- $target := $v.ray.targetPool }}
{{- $tp := int (include "tandem.tp" $ctx) }}
{{- $draftSize := include "tandem.poolSize" (dict "ctx" $ctx "pool" "draft") | fromYaml }}
{{- $targetSize := include "tandem.poolSize" (dict "ctx" $ctx "pool" "target") | fromYaml }}
{{- $targetGpus := mul $tp $target.gpusPerRank }}
{{- $image := include "tandem.imageResource" $ctx }}
{{- $ft := include "tandem.gcsFaultTolerance" $ctx | fromYaml }}
rayVersion: {{ $v.ray.version | quote }}
{{- with $v.ray.upgradeStrategy }}
upgradeStrategy:
  type: {{ . }}
{{- end }}
{{- if $ft.enabled }}
gcsFaultToleranceOptions:
  redisAddress: {{ $ft.address | quote }}
  {{- $password := $v.ray.gcsFaultTolerance.redisPasswordSecret }}
  {{- if and (not $password.name) $v.redis.bundled.enabled (eq $ft.address (printf "%s:6379" (include "tandem.redisName" $ctx))) }}
  {{- /* The bundled Redis requires its password (redis.auth). */}}
  {{- $password = dict "name" (include "tandem.redisSecretName" $ctx) "key" $v.redis.auth.key }}
  {{- end }}
  {{- with $password.name }}
  redisPassword:
    valueFrom:
      secretKeyRef: {name: {{ . }}, key: {{ $password.key }}}
  {{- end }}
  {{- with $v.ray.gcsFaultTolerance.externalStorageNamespace }}
  externalStorageNamespace: {{ . | quote }}
  {{- end }}
{{- end }}
{{- if include "tandem.rayAutoscaling" $ctx }}
enableInTreeAutoscaling: true
{{- /*
KubeRay adds the autoscaler as a second container of the head pod, with none of the head container's settings: it
gets the Ray token (it talks to the GCS), the same restricted securityContext and the same writable /tmp and HOME
(KubeRay mounts its log volume at /tmp/ray on both).
*/}}
autoscalerOptions:
  upscalingMode: Default
  idleTimeoutSeconds: {{ $v.ray.autoscaling.idleTimeoutSeconds }}
  env:
    {{- include "tandem.rayAuthEnv" $ctx | nindent 4 }}
    {{- include "tandem.scratchEnv" $ctx | nindent 4 }}
  volumeMounts:
    {{- include "tandem.scratchMounts" $ctx | nindent 4 }}
  {{- with $v.ray.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
headGroupSpec:
  serviceType: ClusterIP
  rayStartParams:
    {{- /*
    The dashboard (and with it Ray's job submission API: code execution) listens on the head's loopback only; the
    pools Job submits through a task on the head instead (files/submit-on-head.py). tandem.validate refuses another
    dashboard-host in ray.head.rayStartParams.
    */}}
    {{- $head := dict "dashboard-host" "127.0.0.1" "num-cpus" "0" "num-gpus" "0"
        "metrics-export-port" (toString $v.ray.metricsPort) "disable-usage-stats" "true" }}
    {{- include "tandem.rayStartParams" (merge (deepCopy $v.ray.head.rayStartParams) $head) | trim | nindent 4 }}
  template:
    {{- include "tandem.rayPodTemplate" (dict "ctx" $ctx "group" "head" "container" "ray-head" "spec" $v.ray.head
        "gpus" 0 "workers" 0 "fingerprint" .fingerprint) | trim | nindent 4 }}
workerGroupSpecs:
  - groupName: {{ $draft.groupName }}
    replicas: {{ $draftSize.replicas }}
    minReplicas: {{ $draftSize.min }}
    maxReplicas: {{ $draftSize.max }}
    rayStartParams:
      {{- $params := dict "num-cpus" (toString $draft.workersPerPod) "num-gpus" (toString $draft.gpusPerPod)
          "resources" (dict $draft.customResource $draft.workersPerPod $image 1000 | toJson | printf "%q")
          "metrics-export-port" (toString $v.ray.metricsPort) }}
      {{- include "tandem.rayStartParams" (merge (deepCopy $draft.rayStartParams) $params) | trim | nindent 6 }}
    template:
      {{- include "tandem.rayPodTemplate" (dict "ctx" $ctx "group" $draft.groupName "container" "ray-worker"
          "spec" $draft "gpus" $draft.gpusPerPod "workers" $draft.workersPerPod) | trim | nindent 6 }}
  - groupName: {{ $target.groupName }}
    replicas: {{ $targetSize.replicas }}
    minReplicas: {{ $targetSize.min }}
    maxReplicas: {{ $targetSize.max }}
    rayStartParams:
      {{- $params := dict "num-cpus" (toString $tp) "num-gpus" (toString $targetGpus)
          "resources" (dict $target.customResource $tp $image 1000 | toJson | printf "%q")
          "metrics-export-port" (toString $v.ray.metricsPort) }}
      {{- include "tandem.rayStartParams" (merge (deepCopy $target.rayStartParams) $params) | trim | nindent 6 }}
    template:
      {{- include "tandem.rayPodTemplate" (dict "ctx" $ctx "group" $target.groupName "container" "ray-worker"
          "spec" $target "gpus" $targetGpus "workers" $tp) | trim | nindent 6 }}
{{- end }}

{{- /*
A fingerprint of the Ray pods' spec: what KubeRay's Recreate upgrade strategy compares (the spec without replica
counts, tolerations and the strategy itself), minus the fingerprint. It changes exactly when KubeRay replaces every
Ray pod; the head carries it (TANDEM_RAY_SPEC) and the pools Job waits for a head that carries the current one.
*/}}
{{- define "tandem.rayFingerprint" -}}
{{- $spec := include "tandem.rayClusterSpec" (dict "ctx" . "fingerprint" "") | fromYaml }}
{{- $_ := unset $spec "upgradeStrategy" }}
{{- $_ := unset $spec.headGroupSpec.template.spec "tolerations" }}
{{- range $spec.workerGroupSpecs }}
{{- $_ := unset . "replicas" }}
{{- $_ := unset . "minReplicas" }}
{{- $_ := unset . "maxReplicas" }}
{{- $_ := unset .template.spec "tolerations" }}
{{- end }}
{{- toJson $spec | sha256sum | trunc 16 }}
{{- end }}
