{{/*
Names. The full name is kept to 40 characters so that "<fullname>-prefill" stays within
the 52 a StatefulSet name may have (its pods' controller-revision-hash label adds 11).
*/}}
{{- define "atomd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "atomd.fullname" -}}
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

{{- define "atomd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "atomd.labels" -}}
helm.sh/chart: {{ include "atomd.chart" . }}
app.kubernetes.io/name: {{ include "atomd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: atomd
{{- end }}

{{/* Selector labels of one component (router, prefill, decode): {root, component}. */}}
{{- define "atomd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "atomd.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* All labels of one component's objects and pods; atomd.dev/role is the PD role. */}}
{{- define "atomd.componentLabels" -}}
{{ include "atomd.labels" .root }}
app.kubernetes.io/component: {{ .component }}
atomd.dev/role: {{ .component }}
{{- end }}

{{- define "atomd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "atomd.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "atomd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) }}
{{- end }}

{{- define "atomd.apiKeySecretName" -}}
{{- default (printf "%s-api-key" (include "atomd.fullname" .)) .Values.apiKey.existingSecret }}
{{- end }}

{{- define "atomd.adminApiKeySecretName" -}}
{{- default (printf "%s-admin-key" (include "atomd.fullname" .)) .Values.adminApiKey.existingSecret }}
{{- end }}

{{- define "atomd.kvParamsSecretName" -}}
{{- default (printf "%s-kv-params" (include "atomd.fullname" .)) .Values.kvParamsSecret.existingSecret }}
{{- end }}

{{- define "atomd.kvParamsSecretDir" -}}/etc/atomd/kv-params-secret{{- end }}
{{- define "atomd.configDir" -}}/etc/atomd/config{{- end }}
{{- define "atomd.cacheDir" -}}/cache{{- end }}

{{/* The headless Service of an engine role, and its DNS name: {root, role}. */}}
{{- define "atomd.engineService" -}}
{{- printf "%s-%s" (include "atomd.fullname" .root) .role }}
{{- end }}

{{- define "atomd.engineDNS" -}}
{{- printf "%s.%s.svc.%s:%d" (include "atomd.engineService" .) .root.Release.Namespace .root.Values.clusterDomain (int .root.Values.engine.ports.http) }}
{{- end }}

{{/* The model directory the engines load ("" = the built-in default). */}}
{{- define "atomd.modelPath" -}}
{{- $m := .Values.model }}
{{- if $m.pvc }}
{{- $mount := trimSuffix "/" $m.mountPath }}
{{- if not $m.path }}
{{- $mount }}
{{- else if or (eq $m.path $mount) (hasPrefix (printf "%s/" $mount) $m.path) }}
{{- $m.path }}
{{- else }}
{{- fail (printf "model.path %q must lie under model.mountPath %q when model.pvc is set" $m.path $m.mountPath) }}
{{- end }}
{{- else }}
{{- $m.path }}
{{- end }}
{{- end }}

{{/*
One engine role's settings as EngineConfig fields (atomd/config.py), as JSON: the
ConfigMap shows them and the StatefulSet turns each into `--field-name value`, so the
two cannot disagree. Per-pod values (the pod IP) and server flags are added in the
StatefulSet. {root, role}
*/}}
{{- define "atomd.engineConfig" -}}
{{- $v := .root.Values }}
{{- $r := index $v .role }}
{{- $pods := int ($r.podsPerEngine | default 1) }}
{{- $cfg := dict "kv_role" (ternary "producer" "consumer" (eq .role "prefill")) "kv_transfer_backend" $v.kvTransfer.backend "max_model_len" (int $v.engine.maxModelLen) "dtype" $v.engine.dtype "kv_cache_dtype" ($v.engine.kvCacheDtype | default "auto") "data_parallel_size" (mul (int $r.dataParallelSize) $pods) "kv_params_secret_file" (printf "%s/key" (include "atomd.kvParamsSecretDir" .root)) }}
{{- if gt $pods 1 }}
{{- /* an engine over pods: each runs dataParallelSize ranks; its start rank and rank 0's address
     are the pod's own (atomd.multiHostServe), the group's port everyone's */}}
{{- if $v.autoscaler.enabled }}
{{- fail (printf "%s.podsPerEngine > 1 does not go with autoscaler.enabled: the autoscaler adds and removes one pod at a time, and an engine is %d pods" .role $pods) }}
{{- end }}
{{- $_ := set $cfg "data_parallel_size_local" (int $r.dataParallelSize) }}
{{- $_ := set $cfg "dp_master_port" (int $v.engine.ports.dpMaster) }}
{{- end }}
{{- if $r.numThreads }}
{{- $_ := set $cfg "num_threads" (int $r.numThreads) }}
{{- end }}
{{- if $r.expertParallel }}
{{- $_ := set $cfg "enable_expert_parallel" true }}
{{- end }}
{{- $lora := $v.engine.lora }}
{{- $modules := merge (dict) ($r.loraModules | default dict) ($lora.modules | default dict) }}
{{- if $lora.enabled }}
{{- $_ := set $cfg "enable_lora" true }}
{{- $_ := set $cfg "max_loras" (int $lora.maxLoras) }}
{{- $_ := set $cfg "max_lora_rank" (int $lora.maxLoraRank) }}
{{- if $modules }}
{{- $items := list }}
{{- range $name := keys $modules | sortAlpha }}
{{- $items = append $items (printf "%s=%s" $name (index $modules $name)) }}
{{- end }}
{{- $_ := set $cfg "lora_modules" $items }}
{{- end }}
{{- else if $modules }}
{{- fail (printf "%s.loraModules / engine.lora.modules need engine.lora.enabled" .role) }}
{{- end }}
{{- if gt (int $r.tensorParallelSize) 1 }}
{{- $_ := set $cfg "tensor_parallel_size" (int $r.tensorParallelSize) }}
{{- end }}
{{- $model := include "atomd.modelPath" .root }}
{{- if $model }}
{{- $_ := set $cfg "model" $model }}
{{- end }}
{{- if eq .role "prefill" }}
{{- $_ := set $cfg "kv_side_channel_port" (int $v.engine.ports.sideChannel) }}
{{- end }}
{{- if $v.engine.kvEvents.enabled }}
{{- $_ := set $cfg "kv_events_endpoint" (printf "tcp://*:%d" (int $v.engine.ports.kvEvents)) }}
{{- end }}
{{- toJson $cfg }}
{{- end }}

{{/*
The shell line an engine pod of a group over pods runs (`sh -c LINE atomd-serve ARGS...`): the
StatefulSet's pods are numbered in rows of podsPerEngine, one row an engine; pod i runs DP
ranks (i mod podsPerEngine) x dataParallelSize onwards, and its group meets at the row's first
pod, by that pod's DNS name under the headless Service (published before it is ready). $$ is
a $ past Kubernetes' $(VAR) expansion. {root, role}
*/}}
{{- define "atomd.multiHostServe" -}}
{{- $r := index .root.Values .role }}
{{- $pods := int $r.podsPerEngine }}
{{- $svc := include "atomd.engineService" . }}
{{- printf "i=${POD_NAME##*-}; exec atomd serve \"$@\" --data-parallel-start-rank $$((i %% %d * %d)) --data-parallel-address %s-$$((i - i %% %d)).%s.%s.svc.%s" $pods (int $r.dataParallelSize) $svc $pods $svc .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{/* The router's settings as RouterConfig fields (router/app.py), as JSON. */}}
{{- define "atomd.routerConfig" -}}
{{- $r := .Values.router }}
{{- $cfg := dict "policy" $r.policy "health_interval_s" $r.healthIntervalSeconds "request_timeout_s" $r.requestTimeoutSeconds "kv_params_secret_file" (printf "%s/key" (include "atomd.kvParamsSecretDir" .)) }}
{{- /* with the autoscaler the planner registers the engines (DNS would re-add a draining one) */}}
{{- if not .Values.autoscaler.enabled }}
{{- $_ := set $cfg "prefill_dns" (list (include "atomd.engineDNS" (dict "root" . "role" "prefill"))) }}
{{- $_ := set $cfg "decode_dns" (list (include "atomd.engineDNS" (dict "root" . "role" "decode"))) }}
{{- $_ := set $cfg "dns_refresh_s" $r.dnsRefreshSeconds }}
{{- end }}
{{- toJson $cfg }}
{{- end }}

{{/* `--field-name value` for every field of a config dict (lists: the flag per item). */}}
{{- define "atomd.flags" -}}
{{- range $k, $val := . }}
{{- $flag := printf "--%s" (replace "_" "-" $k) }}
{{- if kindIs "slice" $val }}
{{- range $val }}
- {{ $flag | quote }}
- {{ . | toString | quote }}
{{- end }}
{{- else if kindIs "bool" $val }}
{{- if $val }}
- {{ $flag | quote }}
{{- end }}
{{- else }}
- {{ $flag | quote }}
- {{ $val | toString | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The API key as $(ATOMD_API_KEY): env entry. */}}
{{- define "atomd.apiKeyEnv" -}}
{{- if .Values.apiKey.enabled }}
- name: ATOMD_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "atomd.apiKeySecretName" . }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- end }}

{{/* The admin key as $(ATOMD_ADMIN_API_KEY): env entry. */}}
{{- define "atomd.adminApiKeyEnv" -}}
{{- if .Values.adminApiKey.enabled }}
- name: ATOMD_ADMIN_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "atomd.adminApiKeySecretName" . }}
      key: {{ .Values.adminApiKey.secretKey }}
{{- end }}
{{- end }}

{{/* A probe: {path, port, settings}. */}}
{{- define "atomd.probe" -}}
httpGet:
  path: {{ .path }}
  port: {{ .port }}
periodSeconds: {{ .settings.periodSeconds }}
timeoutSeconds: {{ .settings.timeoutSeconds }}
failureThreshold: {{ .settings.failureThreshold }}
{{- end }}

{{/* The kv params secret volume (the file is always .../key). */}}
{{- define "atomd.kvParamsVolume" -}}
- name: kv-params-secret
  secret:
    secretName: {{ include "atomd.kvParamsSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.kvParamsSecret.secretKey }}
        path: key
{{- end }}

{{/* An existing Secret's value for `key`, else a new random one (kept across upgrades). */}}
{{- define "atomd.secretValue" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- if and $existing (hasKey ($existing.data | default dict) .key) }}
{{- index $existing.data .key }}
{{- else }}
{{- randAlphaNum 48 | b64enc }}
{{- end }}
{{- end }}

{{/*
One engine role's container resources: the values' are per TP process, so the CPU requests
and limits are them x tensorParallelSize ("500m" x 2 = "1000m", "2" x 2 = "4"). {role values}
*/}}
{{- define "atomd.engineResources" -}}
{{- $tp := int .tensorParallelSize }}
{{- $out := dict }}
{{- range $kind, $res := .resources }}
{{- $scaled := dict }}
{{- range $name, $q := $res }}
{{- if and (eq $name "cpu") (gt $tp 1) }}
{{- $s := toString $q }}
{{- if hasSuffix "m" $s }}
{{- $_ := set $scaled $name (printf "%dm" (mul (int (trimSuffix "m" $s)) $tp)) }}
{{- else }}
{{- $_ := set $scaled $name (toString (mulf (float64 $s) $tp)) }}
{{- end }}
{{- else }}
{{- $_ := set $scaled $name $q }}
{{- end }}
{{- end }}
{{- $_ := set $out $kind $scaled }}
{{- end }}
{{- toYaml $out }}
{{- end }}
