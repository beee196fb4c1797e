{{/* Names are cut at 45 characters so "<fullname>-valkey-0" and its revision-hash label stay within 63. */}}
{{- define "specserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 45 | trimSuffix "-" }}
{{- end }}

{{- define "specserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specserve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "worker"). */}}
{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specserve.componentLabels" -}}
{{ include "specserve.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Redis keys: must match specserve/queue (stream "<prefix>:requests", group "<prefix>:workers"). */}}
{{/* On a cluster every key is hash-tagged `{<prefix>}` (specserve/queue/keys.py). */}}
{{- define "specserve.redisCluster" -}}
{{- and (eq .Values.redis.mode "external") .Values.redis.external.cluster.enabled }}
{{- end }}
{{- define "specserve.keyBase" -}}
{{- if eq (include "specserve.redisCluster" .) "true" }}{{ printf "{%s}" .Values.prefix }}{{ else }}{{ .Values.prefix }}{{ end }}
{{- end }}
{{- define "specserve.requestStream" -}}{{ include "specserve.keyBase" . }}:requests{{- end }}
{{- define "specserve.consumerGroup" -}}{{ include "specserve.keyBase" . }}:workers{{- end }}
{{/* Shard `shard` of `ctx`'s queue (--queue-shards): with one shard the plain key base, else `<prefix>:s<k>`,
hash-tagged on a cluster. */}}
{{- define "specserve.shardBase" -}}
{{- $ctx := .ctx }}
{{- if le (int $ctx.Values.queue.shards) 1 }}{{ include "specserve.keyBase" $ctx }}
{{- else if eq (include "specserve.redisCluster" $ctx) "true" }}{{ printf "{%s:s%d}" $ctx.Values.prefix (int .shard) }}
{{- else }}{{ printf "%s:s%d" $ctx.Values.prefix (int .shard) }}{{ end }}
{{- end }}

{{/* Images. The variant suffix keeps one repository for the CUDA and the CPU build of the same version; a tag
given with its suffix already (`0.2.0-cuda`) is the version, so the suffix is not doubled. */}}
{{- define "specserve.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag | trimSuffix "-cuda" | trimSuffix "-cpu" }}
{{- end }}

{{- define "specserve.repository" -}}
{{- if .Values.image.registry }}
{{- printf "%s/%s" (trimSuffix "/" .Values.image.registry) .Values.image.repository }}
{{- else }}
{{- .Values.image.repository }}
{{- end }}
{{- end }}

{{- define "specserve.workerImage" -}}
{{- $variant := ternary "cuda" "cpu" (gt (int .Values.worker.gpu.count) 0) }}
{{- $repo := default (include "specserve.repository" .) .Values.worker.image.repository }}
{{- $tag := default (printf "%s-%s" (include "specserve.imageTag" .) $variant) .Values.worker.image.tag }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{- define "specserve.cpuImage" -}}
{{- $repo := default (include "specserve.repository" .) .Values.api.image.repository }}
{{- $tag := default (printf "%s-cpu" (include "specserve.imageTag" .)) .Values.api.image.tag }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{/* Ranks of one worker: engine.tensorParallelSize, else one a GPU where there are several; "" = one. */}}
{{- define "specserve.tensorParallelSize" -}}
{{- if not (kindIs "invalid" .Values.engine.tensorParallelSize) }}
{{- int64 .Values.engine.tensorParallelSize }}
{{- else if gt (int .Values.worker.gpu.count) 1 }}
{{- int64 .Values.worker.gpu.count }}
{{- end }}
{{- end }}

{{/* A Kubernetes quantity ("10Gi", "500M", "1e9") in bytes, as a float. */}}
{{- define "specserve.bytes" -}}
{{- $q := toString . }}
{{- $units := dict "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "k" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 }}
{{- $unit := regexFind "(Ki|Mi|Gi|Ti|k|M|G|T)$" $q }}
{{- mulf (float64 (trimSuffix $unit $q)) (default 1.0 (get $units $unit)) }}
{{- end }}

{{/*
Bytes of bf16 weights a Hugging Face id's name says it has ("Qwen/Qwen2.5-7B-Instruct": 7e9 parameters, two
bytes each, a tenth more for the tokenizer and the download's temporary copy); "" where the name says no size.
*/}}
{{- define "specserve.hfModelBytes" -}}
{{- $path := .Values.model.path }}
{{- if and (eq .Values.model.source "image") (regexMatch "^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+$" $path) }}
{{- $size := regexFind "[0-9]+(\\.[0-9]+)?[BbMm]([^A-Za-z]|$)" (base $path) }}
{{- if $size }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $size }}
{{- $scale := ternary 1000000000.0 1000000.0 (regexMatch "^[0-9.]+[Bb]" $size) }}
{{- mulf (float64 $number) $scale 2.2 }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specserve.device" -}}
{{- if .Values.engine.device }}
{{- .Values.engine.device }}
{{- else }}
{{- ternary "cuda" "cpu" (gt (int .Values.worker.gpu.count) 0) }}
{{- end }}
{{- end }}

{{/* Hardening shared by every specserve container; only the identity is configurable. */}}
{{- define "specserve.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.fsGroup }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "specserve.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Secrets holding Redis credentials. */}}
{{- define "specserve.redisPasswordSecret" -}}
{{- if eq .Values.redis.mode "bundled" }}
{{- default (printf "%s-valkey" (include "specserve.fullname" .)) .Values.redis.bundled.auth.existingSecret }}
{{- else if .Values.redis.external.existingSecret }}
{{- .Values.redis.external.existingSecret }}
{{- else if .Values.redis.external.password }}
{{- printf "%s-redis" (include "specserve.fullname" .) }}
{{- end }}
{{- end }}

{{- define "specserve.redisPasswordKey" -}}
{{- if eq .Values.redis.mode "bundled" }}{{ .Values.redis.bundled.auth.passwordKey }}{{ else }}{{ .Values.redis.external.passwordKey }}{{ end }}
{{- end }}

{{- define "specserve.redisHost" -}}
{{- if eq .Values.redis.mode "bundled" }}
{{- printf "%s-valkey.%s.svc" (include "specserve.fullname" .) .Release.Namespace }}
{{- else }}
{{- .Values.redis.external.host }}
{{- end }}
{{- end }}

{{- define "specserve.redisPort" -}}
{{- if eq .Values.redis.mode "bundled" }}6379{{ else }}{{ .Values.redis.external.port }}{{ end }}
{{- end }}

{{- define "specserve.redisTLS" -}}
{{- and (eq .Values.redis.mode "external") .Values.redis.external.tls.enabled }}
{{- end }}

{{- define "specserve.redisCAPath" -}}/etc/specserve/redis-ca/{{ .Values.redis.external.tls.caKey }}{{- end }}

{{/*
REDIS_URL, assembled by the kubelet from SPECSERVE_REDIS_PASSWORD (a secretKeyRef declared just before it),
so the password never appears in the rendered manifest.
*/}}
{{- define "specserve.redisURL" -}}
{{- $scheme := ternary "rediss" "redis" (eq (include "specserve.redisTLS" .) "true") }}
{{- $auth := "" }}
{{- $user := "" }}
{{- if eq .Values.redis.mode "external" }}{{ $user = .Values.redis.external.username }}{{ end }}
{{- if include "specserve.redisPasswordSecret" . }}
{{- $auth = printf "%s:$(SPECSERVE_REDIS_PASSWORD)@" $user }}
{{- else if $user }}
{{- $auth = printf "%s@" $user }}
{{- end }}
{{- $url := printf "%s://%s%s:%s/%d" $scheme $auth (include "specserve.redisHost" .) (include "specserve.redisPort" .) (int .Values.redis.db) }}
{{- if and (eq (include "specserve.redisTLS" .) "true") .Values.redis.external.tls.caSecret }}
{{- $url = printf "%s?ssl_ca_certs=%s" $url (include "specserve.redisCAPath" .) }}
{{- end }}
{{- $url }}
{{- end }}

{{/* Environment shared by the API and the workers: Redis, key prefix, telemetry. Call with (dict "ctx" $ "component" "api"). */}}
{{- define "specserve.commonEnv" -}}
{{- $ := .ctx -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- with include "specserve.redisPasswordSecret" $ }}
- name: SPECSERVE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ include "specserve.redisPasswordKey" $ }}
{{- end }}
- name: REDIS_URL
  value: {{ include "specserve.redisURL" $ | quote }}
{{- if and (eq (include "specserve.redisCluster" $) "true") $.Values.redis.external.cluster.seedNodes }}
- name: SPECSERVE_REDIS_SEED_NODES
  value: {{ join "," $.Values.redis.external.cluster.seedNodes | quote }}
{{- end }}
- name: SPECSERVE_PREFIX
  value: {{ $.Values.prefix | quote }}
- name: SPECSERVE_QUEUE_SHARDS
  value: {{ int64 $.Values.queue.shards | quote }}
- name: SPECSERVE_MAX_BACKLOG
  value: {{ int64 $.Values.queue.maxBacklog | quote }}
- name: SPECSERVE_TENANT_MAX_QUEUED
  value: {{ int64 $.Values.queue.tenantMaxQueued | quote }}
- name: SPECSERVE_TENANT_TOKENS_PER_MINUTE
  value: {{ int64 $.Values.queue.tenantTokensPerMinute | quote }}
- name: SPECSERVE_HOST
  value: {{ $.Values.listenHost | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "specserve-%s" .component | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ include "specserve.otelResourceAttributes" (dict "ctx" $ "component" .component) | quote }}
{{- with $.Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- /* Caches go to the writable /cache volume: the root filesystem is read-only. */}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /cache
- name: HF_HOME
  value: /cache/huggingface
- name: TRITON_CACHE_DIR
  value: /cache/triton
- name: CUDA_CACHE_PATH
  value: /cache/nv
- name: TORCHINDUCTOR_CACHE_DIR
  value: /cache/inductor
{{- end }}

{{- define "specserve.otelResourceAttributes" -}}
{{- $attrs := list "k8s.pod.name=$(POD_NAME)" "k8s.namespace.name=$(POD_NAMESPACE)" "k8s.node.name=$(NODE_NAME)" (printf "service.namespace=%s" .ctx.Release.Name) (printf "specserve.component=%s" .component) }}
{{- range $k, $v := .ctx.Values.otel.resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $attrs }}
{{- end }}

{{/* Mounts of the Redis CA bundle, when one is configured. */}}
{{- define "specserve.redisCAVolumeMount" -}}
{{- if and (eq (include "specserve.redisTLS" .) "true") .Values.redis.external.tls.caSecret }}
- name: redis-ca
  mountPath: /etc/specserve/redis-ca
  readOnly: true
{{- end }}
{{- end }}

{{- define "specserve.redisCAVolume" -}}
{{- if and (eq (include "specserve.redisTLS" .) "true") .Values.redis.external.tls.caSecret }}
- name: redis-ca
  secret:
    secretName: {{ .Values.redis.external.tls.caSecret }}
    items:
      - key: {{ .Values.redis.external.tls.caKey }}
        path: {{ .Values.redis.external.tls.caKey }}
{{- end }}
{{- end }}

{{/* The API keys Secret. */}}
{{- define "specserve.apiKeysSecret" -}}
{{- default (printf "%s-api-keys" (include "specserve.fullname" .)) .Values.api.auth.existingSecret }}
{{- end }}

{{/* A value kept across upgrades: the live Secret's, else a fresh random one (helm template always generates). */}}
{{- define "specserve.persistentRandom" -}}
{{- $live := lookup "v1" "Secret" .ctx.Release.Namespace .name }}
{{- if and $live $live.data (hasKey $live.data .key) }}
{{- index $live.data .key | b64dec }}
{{- else }}
{{- randAlphaNum 40 }}
{{- end }}
{{- end }}

{{- define "specserve.workerGracePeriod" -}}
{{- $floor := add .Values.worker.preStopSleepSeconds .Values.worker.drainTimeoutSeconds 5 }}
{{- if kindIs "invalid" .Values.worker.terminationGracePeriodSeconds }}
{{- add $floor 10 }}
{{- else if lt (int .Values.worker.terminationGracePeriodSeconds) (int $floor) }}
{{- fail (printf "worker.terminationGracePeriodSeconds (%v) must be at least preStopSleepSeconds + drainTimeoutSeconds + 5 = %d, or the kubelet kills workers mid-drain" .Values.worker.terminationGracePeriodSeconds $floor) }}
{{- else }}
{{- int .Values.worker.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/*
Cross-field checks the schema cannot express with a clear message; they run in every template that includes
them, so `helm template`, `install` and `upgrade` all refuse an inconsistent release.
*/}}
{{- define "specserve.validate" -}}
{{- if eq .Values.redis.mode "external" }}
{{- if not .Values.redis.external.host }}
{{- fail "redis.mode=external needs redis.external.host" }}
{{- end }}
{{- if and .Values.redis.external.existingSecret .Values.redis.external.password }}
{{- fail "set either redis.external.existingSecret or redis.external.password, not both" }}
{{- end }}
{{- else }}
{{- if or .Values.redis.external.host .Values.redis.external.existingSecret .Values.redis.external.password }}
{{- fail "redis.external.* is set but redis.mode is bundled: set redis.mode=external to use your Redis, or clear redis.external to use the bundled Valkey" }}
{{- end }}
{{- end }}
{{- $mount := trimSuffix "/" .Values.model.mountPath }}
{{- if eq .Values.model.source "pvc" }}
{{- if not .Values.model.pvc.claimName }}
{{- fail "model.source=pvc needs model.pvc.claimName" }}
{{- end }}
{{- end }}
{{- if has .Values.model.source (list "pvc" "initContainer") }}
{{- if not (hasPrefix (printf "%s/" $mount) .Values.model.path) }}
{{- fail (printf "model.path (%q) must lie under model.mountPath (%q) when model.source=%s" .Values.model.path $mount .Values.model.source) }}
{{- end }}
{{- end }}
{{- if eq .Values.engine.speculative.method "draft_model" }}
{{- if not .Values.engine.speculative.model }}
{{- fail "engine.speculative.method=draft_model needs engine.speculative.model" }}
{{- end }}
{{- end }}
{{- $tp := .Values.engine.tensorParallelSize }}
{{- if and (not (kindIs "invalid" $tp)) (gt (int .Values.worker.gpu.count) 0) (ne (int $tp) (int .Values.worker.gpu.count)) }}
{{- fail (printf "engine.tensorParallelSize (%v) must equal worker.gpu.count (%v) on GPU workers: one GPU a rank" $tp .Values.worker.gpu.count) }}
{{- end }}
{{- if and (eq (include "specserve.device" .) "cuda") (eq (int .Values.worker.gpu.count) 0) }}
{{- fail "engine.device=cuda needs worker.gpu.count > 0" }}
{{- end }}
{{- if and .Values.worker.keda.enabled (gt (int .Values.worker.keda.minReplicas) (int .Values.worker.keda.maxReplicas)) }}
{{- fail "worker.keda.minReplicas must not exceed worker.keda.maxReplicas" }}
{{- end }}
{{- if le (int .Values.api.terminationGracePeriodSeconds) (int .Values.api.preStopSleepSeconds) }}
{{- fail "api.terminationGracePeriodSeconds must exceed api.preStopSleepSeconds" }}
{{- end }}
{{- if and .Values.api.autoscaling.enabled (gt (int .Values.api.autoscaling.minReplicas) (int .Values.api.autoscaling.maxReplicas)) }}
{{- fail "api.autoscaling.minReplicas must not exceed api.autoscaling.maxReplicas" }}
{{- end }}
{{- end }}
