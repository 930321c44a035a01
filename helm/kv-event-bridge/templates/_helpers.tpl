{{/*
Names, labels, the rendered bridge config, and the container shared by the Deployment, the
StatefulSet and the sidecar snippet. "kv-event-bridge.sidecar.container" and
"kv-event-bridge.sidecar.volumes" are public: a chart that has this one as a dependency can
include them in its own vLLM pod template (docs/operations/chart.md, "Modes").
*/}}

{{- define "kv-event-bridge.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kv-event-bridge.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kv-event-bridge.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kv-event-bridge.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kv-event-bridge.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kv-event-bridge.labels" -}}
helm.sh/chart: {{ include "kv-event-bridge.chart" . }}
{{ include "kv-event-bridge.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: {{ .Values.mode }}
{{- end }}

{{- define "kv-event-bridge.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kv-event-bridge.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kv-event-bridge.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* True (non-empty) when the bridge runs as a StatefulSet of shards. */}}
{{- define "kv-event-bridge.sharded" -}}
{{- if and (eq .Values.mode "deployment") .Values.sharding.enabled }}true{{ end }}
{{- end }}

{{/*
The bridge's config as a dict (YAML; read it back with fromYaml): values.config as given, sections
set to null dropped, plus the chart's defaults:
- engines: when config lists neither `sources` nor `discovery`, deployment mode discovers the
  headless Service vllm-kv.${POD_NAMESPACE}.svc.cluster.local (ports 5557/5558) and sidecar mode
  reads its own engine on loopback, the bridge binding tcp://127.0.0.1:5557 (docs/operations/security.md).
  Listing sources never turns discovery on behind the user's back.
- with sharding, discovery.dns.shard: the count follows `replicas`, each pod takes its ordinal
  from its name.
*/}}
{{- define "kv-event-bridge.configDict" -}}
{{- $config := dict }}
{{- range $key, $value := (.Values.config | default dict) }}
{{- if not (kindIs "invalid" $value) }}
{{- $_ := set $config $key (deepCopy $value) }}
{{- end }}
{{- end }}
{{- if not (or $config.sources $config.discovery) }}
{{- if eq .Values.mode "sidecar" }}
{{- $source := dict "name" "${POD_NAME}" "endpoint" "tcp://127.0.0.1:5557" "bind" true "replay_endpoint" "tcp://127.0.0.1:5558" }}
{{- $_ := set $config "sources" (list $source) }}
{{- else }}
{{- $dns := dict "name" "vllm-kv.${POD_NAMESPACE}.svc.cluster.local" "port" 5557 "replay_port" 5558 "interval" "15s" }}
{{- $_ := set $config "discovery" (dict "dns" $dns) }}
{{- end }}
{{- end }}
{{- if and (include "kv-event-bridge.sharded" .) $config.discovery $config.discovery.dns }}
{{- $shard := dict "count" (int .Values.replicas) "index" "auto" "pod_name" "${POD_NAME}" }}
{{- $_ := set $config.discovery.dns "shard" $shard }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* The bridge's config.yaml (the Secret's one key). */}}
{{- define "kv-event-bridge.config" -}}
{{- include "kv-event-bridge.validate" . }}
{{- include "kv-event-bridge.configDict" . }}
{{- end }}

{{/* The port of config.metrics.listen ("host:port"); probes, Service and scrapes use it. */}}
{{- define "kv-event-bridge.metricsPort" -}}
{{- $listen := "0.0.0.0:9300" }}
{{- if and .Values.config .Values.config.metrics (hasKey .Values.config.metrics "listen") }}
{{- $listen = .Values.config.metrics.listen | toString }}
{{- end }}
{{- $port := regexFind "[0-9]+$" $listen }}
{{- if not $port }}
{{- fail (printf "config.metrics.listen must be host:port with a literal port (the chart's probes and Service need it), got %q" $listen) }}
{{- end }}
{{- $host := regexReplaceAll ":[0-9]+$" $listen "" | lower }}
{{- if regexMatch "^(127\\.[0-9.]+|localhost\\.?|ip6-localhost|ip6-loopback|\\[(0*:)*:?0*1\\]|\\[::ffff:127\\.[0-9.]+\\])$" $host }}
{{- fail (printf "config.metrics.listen %q listens on loopback only: the kubelet's probes, the Service and Prometheus reach the pod IP, where nothing would answer (the probes fail and the pod restarts for ever). Listen on 0.0.0.0:%s (or [::]:%s) and admit the port only from Prometheus with a NetworkPolicy (docs/operations/security.md)" $listen $port $port) }}
{{- end }}
{{- $port }}
{{- end }}

{{/* Checks across values that a JSON schema cannot express; rendered (empty) by every manifest. */}}
{{- define "kv-event-bridge.validate" -}}
{{- $config := .Values.config | default dict }}
{{- $path := "" }}
{{- if and $config.checkpoint $config.checkpoint.path }}
{{- $path = $config.checkpoint.path | toString }}
{{- if not (hasPrefix (printf "%s/" (trimSuffix "/" .Values.checkpoint.mountPath)) $path) }}
{{- fail (printf "config.checkpoint.path %q must be under checkpoint.mountPath %q (the root filesystem is read-only)" $path .Values.checkpoint.mountPath) }}
{{- end }}
{{- end }}
{{- $effective := include "kv-event-bridge.configDict" . | fromYaml }}
{{- if include "kv-event-bridge.sharded" . }}
{{- if not (and $effective.discovery $effective.discovery.dns) }}
{{- fail "sharding.enabled needs config.discovery.dns: shards split the discovered engines" }}
{{- end }}
{{- if .Values.checkpoint.persistence.existingClaim }}
{{- fail "checkpoint.persistence.existingClaim cannot be shared by shards: leave it empty (each shard gets its own claim)" }}
{{- end }}
{{- else if and (eq .Values.mode "deployment") (gt (int .Values.replicas) 1) }}
{{- fail "replicas > 1 needs sharding.enabled: unsharded bridges would each publish every event" }}
{{- end }}
{{- $_ := include "kv-event-bridge.metricsPort" . }}
{{- include "kv-event-bridge.validateMemory" (dict "ctx" . "config" $effective) }}
{{- end }}

{{/*
Bytes of a bridge size (65536, "64KiB", "16MiB", "1GiB", "10MB"), as a float; "" when it is a
${VAR} placeholder (known only in the pod). dict: value, path (named in the error).
*/}}
{{- define "kv-event-bridge.bytes" -}}
{{- $v := .value }}
{{- if or (kindIs "float64" $v) (kindIs "int64" $v) (kindIs "int" $v) }}
{{- float64 $v }}
{{- else if contains "${" (toString $v) }}
{{- else }}
{{- $m := regexFindAll "^\\s*([0-9]+)\\s*([A-Za-z]*)\\s*$" (toString $v) -1 }}
{{- $units := dict "" 1 "b" 1 "kb" 1000 "kib" 1024 "mb" 1000000 "mib" 1048576 "gb" 1000000000 "gib" 1073741824 }}
{{- $unit := lower (regexReplaceAll "^\\s*[0-9]+\\s*([A-Za-z]*)\\s*$" (toString $v) "${1}") }}
{{- if or (not $m) (not (hasKey $units $unit)) }}
{{- fail (printf "%s: %q is not a size such as 16MiB or 65536" .path (toString $v)) }}
{{- end }}
{{- mulf (float64 (regexFind "[0-9]+" (toString $v))) (index $units $unit) }}
{{- end }}
{{- end }}

{{/*
The memory limit against the sinks' queue bounds (docs/operations/sizing.md): a pod needs about 128 MiB plus,
for each sink, up to 9 x its queue.max_bytes (a queued batch also holds its decoded events).
Skipped without resources.limits.memory, or when a bound is a ${VAR} placeholder.
dict: ctx, config (the effective config).
*/}}
{{- define "kv-event-bridge.validateMemory" -}}
{{- $limit := "" }}
{{- with .ctx.Values.resources }}{{ with .limits }}{{ with .memory }}{{ $limit = ternary (int64 . | toString) (toString .) (kindIs "float64" .) }}{{ end }}{{ end }}{{ end }}
{{- if $limit }}
{{- $m := regexFind "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$" $limit }}
{{- if not $m }}
{{- fail (printf "resources.limits.memory %q: the chart reads quantities such as 1Gi, 512Mi, 1.5Gi or 1000M (write it that way)" $limit) }}
{{- end }}
{{- $units := dict "" 1.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "k" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 }}
{{- $limitBytes := mulf (float64 (regexFind "^[0-9]+(\\.[0-9]+)?" $limit)) (index $units (regexReplaceAll "^[0-9.]+" $limit "")) }}
{{- $mib := 1048576.0 }}
{{- $need := mulf 128.0 $mib }}
{{- $parts := list }}
{{- $known := true }}
{{- range $i, $sink := (.config.sinks | default list) }}
{{- $bound := 67108864.0 }}
{{- if and (kindIs "map" $sink.queue) (hasKey $sink.queue "max_bytes") }}
{{- $b := include "kv-event-bridge.bytes" (dict "value" $sink.queue.max_bytes "path" (printf "config.sinks[%d].queue.max_bytes" $i)) }}
{{- if $b }}{{ $bound = float64 $b }}{{ else }}{{ $known = false }}{{ end }}
{{- end }}
{{- $need = addf $need (mulf 9.0 $bound) }}
{{- $parts = append $parts (printf "9 x %s MiB (sinks[%d] %s)" (round (divf $bound $mib) 1 | toString) $i ($sink.name | default $sink.type)) }}
{{- end }}
{{- if and $known (gt $need $limitBytes) }}
{{- fail (printf "resources.limits.memory %s (%s MiB) is below what the sinks' queues may hold: 128 MiB + %s = %s MiB (docs/operations/sizing.md). Raise resources.limits.memory to at least %s MiB or lower the sinks' queue.max_bytes" $limit (round (divf $limitBytes $mib) 1 | toString) (join " + " $parts) (round (divf $need $mib) 1 | toString) (divf $need $mib | ceil | toString)) }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kv-event-bridge.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- range .Values.secretEnv }}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .key }}
      {{- if hasKey . "optional" }}
      optional: {{ .optional }}
      {{- end }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The bridge container. Takes a dict: ctx (the chart context), name (container name), readiness
(bool), portName.
*/}}
{{- define "kv-event-bridge.containerSpec" -}}
{{- $ctx := .ctx }}
{{- $v := $ctx.Values }}
{{- $port := include "kv-event-bridge.metricsPort" $ctx -}}
- name: {{ .name }}
  image: {{ include "kv-event-bridge.image" $ctx }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  args: ["--config", "/etc/kv-event-bridge/config.yaml"]
  env:
    {{- include "kv-event-bridge.env" $ctx | nindent 4 }}
  {{- with $v.envFrom }}
  envFrom:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  ports:
    - name: {{ .portName }}
      containerPort: {{ $port }}
      protocol: TCP
  {{- if $v.probes.startup.enabled }}
  startupProbe:
    httpGet:
      path: /healthz
      port: {{ .portName }}
    periodSeconds: {{ $v.probes.startup.periodSeconds }}
    timeoutSeconds: {{ $v.probes.startup.timeoutSeconds }}
    failureThreshold: {{ $v.probes.startup.failureThreshold }}
  {{- end }}
  {{- if $v.probes.liveness.enabled }}
  livenessProbe:
    httpGet:
      path: /healthz
      port: {{ .portName }}
    periodSeconds: {{ $v.probes.liveness.periodSeconds }}
    timeoutSeconds: {{ $v.probes.liveness.timeoutSeconds }}
    failureThreshold: {{ $v.probes.liveness.failureThreshold }}
  {{- end }}
  {{- if and .readiness $v.probes.readiness.enabled }}
  readinessProbe:
    httpGet:
      path: /readyz
      port: {{ .portName }}
    periodSeconds: {{ $v.probes.readiness.periodSeconds }}
    timeoutSeconds: {{ $v.probes.readiness.timeoutSeconds }}
    failureThreshold: {{ $v.probes.readiness.failureThreshold }}
  {{- end }}
  {{- with $v.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: {{ .volumePrefix }}config
      mountPath: /etc/kv-event-bridge
      readOnly: true
    - name: {{ .volumePrefix }}checkpoint
      mountPath: {{ $v.checkpoint.mountPath }}
    - name: {{ .volumePrefix }}tmp
      mountPath: /tmp
{{- end }}

{{/* Pod volumes; dict: ctx, volumePrefix, checkpointClaim ("" for an emptyDir, "-" for none). */}}
{{- define "kv-event-bridge.volumeSpecs" -}}
- name: {{ .volumePrefix }}config
  secret:
    secretName: {{ include "kv-event-bridge.fullname" .ctx }}
{{- if eq .checkpointClaim "" }}
- name: {{ .volumePrefix }}checkpoint
  emptyDir:
    sizeLimit: 64Mi
{{- else if ne .checkpointClaim "-" }}
- name: {{ .volumePrefix }}checkpoint
  persistentVolumeClaim:
    claimName: {{ .checkpointClaim }}
{{- end }}
- name: {{ .volumePrefix }}tmp
  emptyDir:
    sizeLimit: 64Mi
{{- end }}

{{/*
Public: the sidecar container, for a vLLM pod template. Volume names are prefixed (kv-event-bridge-)
so they cannot clash with the pod's own. Include with this chart's context, e.g. from a parent chart:
  {{- include "kv-event-bridge.sidecar.container" (index .Subcharts "kv-event-bridge") | nindent 8 }}
*/}}
{{- define "kv-event-bridge.sidecar.container" -}}
{{- $c := include "kv-event-bridge.containerSpec" (dict "ctx" . "name" .Values.sidecar.containerName "readiness" .Values.sidecar.readiness "portName" "kvb-metrics" "volumePrefix" "kv-event-bridge-") | fromYamlArray }}
{{- $container := first $c }}
{{- if .Values.sidecar.native }}
{{- $_ := set $container "restartPolicy" "Always" }}
{{- end }}
{{- list $container | toYaml }}
{{- end }}

{{/* Public: the volumes the sidecar container needs. */}}
{{- define "kv-event-bridge.sidecar.volumes" -}}
{{- include "kv-event-bridge.volumeSpecs" (dict "ctx" . "volumePrefix" "kv-event-bridge-" "checkpointClaim" "") }}
{{- end }}

{{/* Pod-level fields shared by the Deployment and the StatefulSet. */}}
{{- define "kv-event-bridge.podSpecCommon" -}}
serviceAccountName: {{ include "kv-event-bridge.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "kv-event-bridge.podMetadata" -}}
annotations:
  checksum/config: {{ include "kv-event-bridge.config" . | sha256sum }}
  {{- with .Values.podAnnotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
labels:
  {{- include "kv-event-bridge.labels" . | nindent 2 }}
  {{- with .Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
