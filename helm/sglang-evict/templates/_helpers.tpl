{{/*
Names, labels and the values-derived pieces every template shares. Anything computed
from values is computed here once, so templates and NOTES.txt agree.
*/}}

{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "sglang-evict.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object-name prefix: <release>-<chart>, or the release name when it contains the chart name. */}}
{{- define "sglang-evict.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Name of a component's objects: <fullname>-<suffix>, within 63 characters. */}}
{{- define "sglang-evict.componentName" -}}
{{- printf "%s-%s" (include "sglang-evict.fullname" .ctx | trunc (int (sub 62 (len .suffix))) | trimSuffix "-") .suffix -}}
{{- end -}}

{{- define "sglang-evict.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels of one component. Call with (dict "ctx" $ "component" "server"). */}}
{{- define "sglang-evict.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sglang-evict.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* All labels of one component's objects. Call with (dict "ctx" $ "component" "server"). */}}
{{- define "sglang-evict.labels" -}}
helm.sh/chart: {{ include "sglang-evict.chart" .ctx }}
{{ include "sglang-evict.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: sglang-evict
{{- end -}}

{{- define "sglang-evict.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "sglang-evict.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "sglang-evict.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* "true" when a compactor process runs, in either placement. */}}
{{- define "sglang-evict.compactorEnabled" -}}
{{- if .Values.compactor.enabled -}}true{{- end -}}
{{- end -}}

{{/* "true" when the compactor runs inside the SGLang container under the supervisor. */}}
{{- define "sglang-evict.compactorInContainer" -}}
{{- if and .Values.compactor.enabled (eq .Values.compactor.placement "inContainer") -}}true{{- end -}}
{{- end -}}

{{/* "true" when the compactor runs as a sidecar sharing a DRA GPU claim. */}}
{{- define "sglang-evict.compactorSidecar" -}}
{{- if and .Values.compactor.enabled (eq .Values.compactor.placement "sidecar") -}}true{{- end -}}
{{- end -}}

{{/*
The compactor's socket: in a subdirectory of the socket emptyDir, which the compactor
creates 0700 itself. An emptyDir is mode 0777, and the compactor refuses a socket
directory others can write (they could replace the socket).
*/}}
{{- define "sglang-evict.socketPath" -}}
{{- printf "%s/compactor/compactor.sock" (trimSuffix "/" .Values.compactor.socketDir) -}}
{{- end -}}

{{/* "true" when the in-chart Redis is deployed (an external URL replaces it). */}}
{{- define "sglang-evict.redisInChart" -}}
{{- if and .Values.redis.enabled (not .Values.redis.externalUrl) (not .Values.redis.externalUrlSecret.name) -}}true{{- end -}}
{{- end -}}

{{/* "true" when the lease store is Redis (in-chart or external); else the plugin's in-process store. */}}
{{- define "sglang-evict.leaseStoreRedis" -}}
{{- if or .Values.redis.enabled .Values.redis.externalUrl .Values.redis.externalUrlSecret.name -}}true{{- end -}}
{{- end -}}

{{/* Environment variable carrying the Redis URL to both processes. */}}
{{- define "sglang-evict.redisUrlEnv" -}}SGLANG_EVICT_REDIS_URL{{- end -}}

{{/* The Redis URL when it is not a Secret's: the external URL or the in-chart Redis. */}}
{{- define "sglang-evict.redisUrl" -}}
{{- if .Values.redis.externalUrl -}}
{{- .Values.redis.externalUrl -}}
{{- else -}}
{{- printf "redis://%s:%d/0" (include "sglang-evict.componentName" (dict "ctx" . "suffix" "redis")) (int .Values.redis.port) -}}
{{- end -}}
{{- end -}}

{{/*
The env entry of the Redis URL (empty without Redis): from the Secret when one is named,
else the URL itself. The URL never appears in a container's args: the kubelet would
expand it into the command line, which every user of the node can read in /proc.
`serve` and `compactor` both read $SGLANG_EVICT_REDIS_URL.
*/}}
{{- define "sglang-evict.redisUrlEnvEntry" -}}
{{- if .Values.redis.externalUrlSecret.name }}
- name: {{ include "sglang-evict.redisUrlEnv" . }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.externalUrlSecret.name }}
      key: {{ .Values.redis.externalUrlSecret.key }}
{{- else if include "sglang-evict.leaseStoreRedis" . }}
- name: {{ include "sglang-evict.redisUrlEnv" . }}
  value: {{ include "sglang-evict.redisUrl" . | quote }}
{{- end }}
{{- end -}}

{{/* The compactor's OpenTelemetry variables as NAME=VALUE lines (empty without an endpoint). */}}
{{- define "sglang-evict.otelPairs" -}}
{{- if .Values.tracing.otlpEndpoint }}
OTEL_EXPORTER_OTLP_ENDPOINT={{ printf "%s://%s" .Values.tracing.otlpScheme .Values.tracing.otlpEndpoint }}
OTEL_SERVICE_NAME={{ include "sglang-evict.componentName" (dict "ctx" . "suffix" "compactor") }}
OTEL_TRACES_EXPORTER=otlp
{{- end }}
{{- end -}}

{{/* Arguments of `sglang-evict` for the compactor process, as a YAML list. */}}
{{- define "sglang-evict.compactorArgs" -}}
- compactor
- --socket
- {{ include "sglang-evict.socketPath" . | quote }}
{{- if include "sglang-evict.leaseStoreRedis" . }}
- --lease-namespace
- "$(POD_NAME)"
{{- end }}
- --kernel
- {{ .Values.compactor.kernel | quote }}
- --log-format
- {{ .Values.compactor.logFormat | quote }}
{{- end -}}

{{/*
The whole compactor command line of placement inContainer, as a YAML list. The
supervisor starts it, so its OTEL_* variables go through `env` and reach the compactor
only, not SGLang's processes (which take their tracing set-up from their own flags).
*/}}
{{- define "sglang-evict.compactorCommandInContainer" -}}
{{- with include "sglang-evict.otelPairs" . | trim }}
- env
{{- range splitList "\n" . }}
- {{ . | quote }}
{{- end }}
{{- end }}
- sglang-evict
{{ include "sglang-evict.compactorArgs" . }}
{{- end -}}

{{/* The compactor's gRPC health check, as an exec probe command. */}}
{{- define "sglang-evict.compactorHealthCommand" -}}
- sglang-evict
- compactor-health
- --socket
- {{ include "sglang-evict.socketPath" . | quote }}
{{- end -}}

{{/* Stats file path of the scorer (empty when no stats source is set). */}}
{{- define "sglang-evict.scorerStatsPath" -}}
{{- $stats := .Values.eviction.scorerStats -}}
{{- if or $stats.configMap $stats.existingClaim -}}
{{- printf "%s/%s" (trimSuffix "/" $stats.mountPath) $stats.fileName -}}
{{- end -}}
{{- end -}}

{{/* Arguments of `sglang-evict` for the server (`serve`, SGLang flags, eviction flags) as a YAML list. */}}
{{- define "sglang-evict.serveArgs" -}}
{{- $e := .Values.eviction -}}
- serve
- --model-path
- {{ .Values.model.path | quote }}
- --tp-size
- {{ .Values.sglang.tpSize | int | quote }}
- --host
- "0.0.0.0"
- --port
- {{ .Values.sglang.port | int | quote }}
- --page-size
- {{ .Values.sglang.pageSize | int | quote }}
{{- if .Values.sglang.enableMetrics }}
- --enable-metrics
{{- end }}
{{- if .Values.tracing.otlpEndpoint }}
- --enable-trace
- --otlp-traces-endpoint
- {{ .Values.tracing.otlpEndpoint | quote }}
{{- end }}
- --kv-budget
- {{ $e.kvBudget | int | quote }}
- --kv-cadence
- {{ $e.kvCadence | int | quote }}
{{- if gt (int ($e.kvPassGroupSteps | default 1)) 1 }}
- --kv-pass-group-steps
- {{ $e.kvPassGroupSteps | int | quote }}
{{- end }}
- --kv-sink-tokens
- {{ $e.kvSinkTokens | int | quote }}
- --kv-protected-tokens
- {{ $e.kvProtectedTokens | int | quote }}
- --kv-window
- {{ $e.kvWindow | int | quote }}
- --kv-scorer
- {{ $e.kvScorer | quote }}
{{- with include "sglang-evict.scorerStatsPath" . }}
- --kv-scorer-stats
- {{ . | quote }}
{{- end }}
- --kv-compaction
- {{ $e.kvCompaction | quote }}
{{- if $e.kvRequestMaxBudget }}
- --kv-request-max-budget
- {{ $e.kvRequestMaxBudget | int | quote }}
{{- end }}
{{- if $e.kvRequestMaxCadence }}
- --kv-request-max-cadence
- {{ $e.kvRequestMaxCadence | int | quote }}
{{- end }}
{{- if $e.kvRequestAllowDisable }}
- --kv-request-allow-disable
{{- end }}
- --kv-admission
- {{ $e.kvAdmission | quote }}
{{- if not $e.kvPressurePasses }}
- --kv-no-pressure-passes
{{- end }}
{{- if $e.kvEvictPrompt }}
- --kv-evict-prompt
{{- end }}
{{- if $e.tier.bits }}
- --kv-tier-bits
- {{ $e.tier.bits | int | quote }}
- --kv-tier-group
- {{ $e.tier.groupTokens | int | quote }}
- --kv-tier-tokens
- {{ $e.tier.maxTokens | int | quote }}
- --kv-tier-pool-share
- {{ $e.tier.poolShare | toString | quote }}
{{- end }}
{{- if include "sglang-evict.compactorEnabled" . }}
- --kv-compactor
- grpc
- --kv-compactor-socket
- {{ include "sglang-evict.socketPath" . | quote }}
- --kv-compactor-fallback
- {{ .Values.compactor.fallback | quote }}
- --kv-compactor-timeout-ms
- {{ .Values.compactor.timeoutMs | int | quote }}
{{- else }}
- --kv-compactor
- inprocess
{{- end }}
{{- if include "sglang-evict.leaseStoreRedis" . }}
- --kv-lease-store
- redis
- --kv-lease-namespace
- "$(POD_NAME)"
{{- else }}
- --kv-lease-store
- inprocess
{{- end }}
{{- range .Values.sglang.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/*
The router's image: the chart's own image unless router.image names another (the
project's image has sglang-router when built with the `router` extra).
*/}}
{{- define "sglang-evict.routerImage" -}}
{{- $r := .Values.router.image -}}
{{- printf "%s:%s" (default .Values.image.repository $r.repository) (default (default .Chart.AppVersion .Values.image.tag) $r.tag) -}}
{{- end -}}

{{/*
Arguments of SGLang's router (`python3 -m sglang_router.launch_router`), as a YAML list.
It finds the SGLang pods itself (Kubernetes service discovery: the server's selector
labels, in the release namespace, on sglang.port), so replicas join and leave as they
come and go; the SGLang Service plays no part.
*/}}
{{- define "sglang-evict.routerArgs" -}}
- --host
- "0.0.0.0"
- --port
- {{ .Values.router.port | int | quote }}
- --policy
- {{ .Values.router.policy | quote }}
- --service-discovery
- --selector
{{- range $key, $value := include "sglang-evict.selectorLabels" (dict "ctx" . "component" "server") | fromYaml }}
- {{ printf "%s=%s" $key $value | quote }}
{{- end }}
- --service-discovery-port
- {{ .Values.sglang.port | int | quote }}
- --service-discovery-namespace
- {{ .Release.Namespace | quote }}
- --prometheus-host
- "0.0.0.0"
- --prometheus-port
- {{ .Values.router.prometheusPort | int | quote }}
{{- range .Values.router.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/*
Value combinations the schema cannot express, refused with the reason and the fix.
Mirrors what `sglang-evict serve` and EvictionConfig refuse, so a bad release fails at
`helm install` instead of in a crash-looping pod.
*/}}
{{- define "sglang-evict.validate" -}}
{{- $e := .Values.eviction -}}
{{- if and (eq $e.kvScorer "triattention") (gt (int .Values.sglang.tpSize) 1) -}}
{{- fail (printf "eviction.kvScorer=triattention with sglang.tpSize=%d is not supported yet (each rank holds different KV heads); use knorm, streaming or random, or sglang.tpSize=1" (int .Values.sglang.tpSize)) -}}
{{- end -}}
{{- if and $e.scorerStats.configMap $e.scorerStats.existingClaim -}}
{{- fail "eviction.scorerStats: set configMap or existingClaim, not both" -}}
{{- end -}}
{{- if and (eq $e.kvScorer "triattention") (not (include "sglang-evict.scorerStatsPath" .)) -}}
{{- fail "eviction.kvScorer=triattention needs its stats file (--kv-scorer-stats): set eviction.scorerStats.configMap or eviction.scorerStats.existingClaim (file from `sglang-evict calibrate`)" -}}
{{- end -}}
{{- $kept := add $e.kvSinkTokens $e.kvProtectedTokens $e.kvWindow -}}
{{- if le (int $e.kvBudget) (int $kept) -}}
{{- fail (printf "eviction.kvBudget=%d leaves no room to choose: it must exceed kvSinkTokens + kvProtectedTokens + kvWindow = %d; raise kvBudget or lower kvWindow/kvSinkTokens/kvProtectedTokens" (int $e.kvBudget) (int $kept)) -}}
{{- end -}}
{{- if and $e.kvRequestMaxBudget (lt (int $e.kvRequestMaxBudget) (int $e.kvBudget)) -}}
{{- fail (printf "eviction.kvRequestMaxBudget=%d is below eviction.kvBudget=%d: a request's maximum cannot be below the default it starts from; raise it, or 0 for kvBudget" (int $e.kvRequestMaxBudget) (int $e.kvBudget)) -}}
{{- end -}}
{{- if and $e.kvRequestMaxCadence (lt (int $e.kvRequestMaxCadence) (int $e.kvCadence)) -}}
{{- fail (printf "eviction.kvRequestMaxCadence=%d is below eviction.kvCadence=%d: a request's maximum cannot be below the default it starts from; raise it, or 0 for kvCadence" (int $e.kvRequestMaxCadence) (int $e.kvCadence)) -}}
{{- end -}}
{{- $owned := list "--model-path" "--tp-size" "--tp" "--host" "--port" "--page-size" "--enable-metrics" "--enable-trace" "--otlp-traces-endpoint" "--radix-cache-backend" -}}
{{- /* The --kv-* flags the chart renders from eviction, compactor and redis (serveArgs); other --kv-* flags pass through. */ -}}
{{- $owned = concat $owned (list "--kv-budget" "--kv-cadence" "--kv-pass-group-steps" "--kv-sink-tokens" "--kv-protected-tokens" "--kv-window" "--kv-scorer" "--kv-scorer-stats" "--kv-compaction" "--kv-request-max-budget" "--kv-request-max-cadence" "--kv-request-allow-disable" "--kv-admission" "--kv-no-pressure-passes" "--kv-evict-prompt" "--kv-tier-bits" "--kv-tier-group" "--kv-tier-tokens" "--kv-tier-pool-share" "--kv-lease-store" "--kv-lease-namespace") -}}
{{- range .Values.sglang.extraArgs -}}
{{- $flag := first (splitList "=" .) -}}
{{- if has $flag $owned -}}
{{- fail (printf "sglang.extraArgs: %s is set by the chart from values (model, sglang, eviction, compactor, redis, tracing); set the value instead" $flag) -}}
{{- end -}}
{{- if hasPrefix "--kv-compactor" $flag -}}
{{- fail (printf "sglang.extraArgs: %s: the chart runs and connects the compactor from the compactor values; set those instead" $flag) -}}
{{- end -}}
{{- if hasPrefix "--kv-redis-url" $flag -}}
{{- fail (printf "sglang.extraArgs: %s: the Redis URL is a secret and never goes on a command line; set redis.externalUrlSecret (or redis.externalUrl) instead" $flag) -}}
{{- end -}}
{{- if and (hasPrefix "--kv-tier-" $flag) (not $e.tier.bits) -}}
{{- fail (printf "sglang.extraArgs: %s without eviction.tier.bits: no tier runs without its bits; set eviction.tier.bits (2, 3, 4 or 8) or drop %s" $flag $flag) -}}
{{- end -}}
{{- end -}}
{{- if $e.tier.bits -}}
{{- if include "sglang-evict.compactorEnabled" . -}}
{{- fail "eviction.tier.bits with compactor.enabled: the sidecar demotes into the tier's arena on CPU only so far (the arena's CUDA IPC export has not run on a GPU yet), and this chart serves on GPUs; set compactor.enabled=false (the scheduler compacts in-process)" -}}
{{- end -}}
{{- $backend := "" -}}
{{- range $i, $arg := .Values.sglang.extraArgs -}}
{{- if hasPrefix "--attention-backend=" $arg -}}
{{- $backend = trimPrefix "--attention-backend=" $arg -}}
{{- else if and (eq $arg "--attention-backend") (lt (add1 $i) (len $.Values.sglang.extraArgs)) -}}
{{- $backend = index $.Values.sglang.extraArgs (add1 $i) -}}
{{- end -}}
{{- end -}}
{{- if ne $backend "torch_native" -}}
{{- fail (printf "eviction.tier.bits with %s: on a GPU the tier's attention merges with SGLang's torch_native backend only (its merge with triton has not run on a GPU yet); add \"--attention-backend\", \"torch_native\" to sglang.extraArgs" (ternary (printf "--attention-backend %s" $backend) "SGLang's default attention backend" (ne $backend ""))) -}}
{{- end -}}
{{- if or (lt (int $e.tier.maxTokens) (int $e.tier.groupTokens)) (mod (int $e.tier.maxTokens) (int $e.tier.groupTokens)) -}}
{{- fail (printf "eviction.tier.maxTokens=%d: the tier holds whole groups of eviction.tier.groupTokens=%d tokens; give a multiple of %d" (int $e.tier.maxTokens) (int $e.tier.groupTokens) (int $e.tier.groupTokens)) -}}
{{- end -}}
{{- end -}}
{{- if .Values.router.enabled -}}
{{- /* The router flags the chart sets, each with what to do instead. */ -}}
{{- $bind := "the chart binds 0.0.0.0 so the Service reaches the pod; remove it" -}}
{{- $discovery := "the chart discovers this release's SGLang pods by their selector labels; remove it" -}}
{{- $routerOwned := dict "--host" $bind "--prometheus-host" $bind "--service-discovery" $discovery "--selector" $discovery -}}
{{- $_ := set $routerOwned "--port" "set router.port instead" -}}
{{- $_ := set $routerOwned "--policy" "set router.policy instead" -}}
{{- $_ := set $routerOwned "--prometheus-port" "set router.prometheusPort instead" -}}
{{- $_ := set $routerOwned "--service-discovery-port" "set sglang.port instead" -}}
{{- $_ := set $routerOwned "--service-discovery-namespace" "the router watches the release namespace only (its Role is namespaced); install the release there instead" -}}
{{- range .Values.router.extraArgs -}}
{{- $flag := first (splitList "=" .) -}}
{{- if hasKey $routerOwned $flag -}}
{{- fail (printf "router.extraArgs: %s is set by the chart; %s" $flag (get $routerOwned $flag)) -}}
{{- end -}}
{{- end -}}
{{- if eq (int .Values.router.port) (int .Values.router.prometheusPort) -}}
{{- fail (printf "router.port and router.prometheusPort are both %d: the API and the router's metrics need a port each" (int .Values.router.port)) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.redis.externalUrl .Values.redis.externalUrlSecret.name -}}
{{- fail "redis: set externalUrl or externalUrlSecret.name, not both" -}}
{{- end -}}
{{- if include "sglang-evict.compactorSidecar" . -}}
{{- if not (semverCompare ">=1.34.0-0" .Capabilities.KubeVersion.Version) -}}
{{- fail (printf "compactor.placement=sidecar shares one GPU ResourceClaim between containers (Dynamic Resource Allocation, resource.k8s.io/v1), which needs Kubernetes >= 1.34; this cluster is %s: use compactor.placement=inContainer" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- if eq (not .Values.dra.createClaimTemplate) (not .Values.dra.existingClaimTemplate) -}}
{{- fail "compactor.placement=sidecar needs exactly one GPU claim source: dra.createClaimTemplate=true or dra.existingClaimTemplate=<name>" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.serviceMonitor.enabled (not .Values.sglang.enableMetrics) -}}
{{- fail "serviceMonitor.enabled needs sglang.enableMetrics=true (no /metrics to scrape otherwise)" -}}
{{- end -}}
{{- if and .Values.serviceMonitor.enabled (not .Values.service.enabled) -}}
{{- fail "serviceMonitor.enabled needs service.enabled=true (the ServiceMonitor selects the Service)" -}}
{{- end -}}
{{- if .Values.autoscaling.enabled -}}
{{- if not .Values.autoscaling.metrics -}}
{{- fail "autoscaling.enabled needs autoscaling.metrics (autoscaling/v2 MetricSpec list), e.g. a Pods metric from a Prometheus adapter" -}}
{{- end -}}
{{- if gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas) -}}
{{- fail "autoscaling.minReplicas must not exceed autoscaling.maxReplicas" -}}
{{- end -}}
{{- end -}}
{{- end -}}
