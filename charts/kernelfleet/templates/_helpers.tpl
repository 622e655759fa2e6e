{{/*
Names, labels and the values that several templates derive in the same way. Every derived value
(image references, the store, the pools) is computed here once, so the operator's environment,
the pools ConfigMap and the optional servers can never disagree.
*/}}

{{- define "kernelfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Object names: `<release>-<chart>`, or the release alone when it already contains the chart name. */}}
{{- define "kernelfleet.fullname" -}}
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

{{/* A name for one component: `<fullname>-<suffix>`, kept within the 63 characters a Service name allows. */}}
{{- define "kernelfleet.componentName" -}}
{{- $full := include "kernelfleet.fullname" .root }}
{{- printf "%s-%s" ($full | trunc (int (sub 62 (len .component)))) .component | trimSuffix "-" }}
{{- end }}

{{- define "kernelfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The labels every object carries. */}}
{{- define "kernelfleet.labels" -}}
helm.sh/chart: {{ include "kernelfleet.chart" . }}
{{ include "kernelfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kernelfleet
{{- end }}

{{- define "kernelfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kernelfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels and selector labels of one component; call with (dict "root" $ "component" "operator"). */}}
{{- define "kernelfleet.componentLabels" -}}
{{ include "kernelfleet.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kernelfleet.componentSelectorLabels" -}}
{{ include "kernelfleet.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kernelfleet.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "kernelfleet.fullname" .) .Values.operator.serviceAccount.name }}
{{- else if .Values.operator.serviceAccount.name }}
{{- .Values.operator.serviceAccount.name }}
{{- else }}
{{- fail "operator.serviceAccount.create is false, so operator.serviceAccount.name must name an existing ServiceAccount: set it, or set operator.serviceAccount.create=true" }}
{{- end }}
{{- end }}

{{/* An image reference; call with (dict "image" .Values.images.worker "root" $). */}}
{{- define "kernelfleet.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag | toString) }}
{{- end }}

{{/* ------------------------------------------------------------------ the store */}}

{{- define "kernelfleet.minioName" -}}
{{- include "kernelfleet.componentName" (dict "root" . "component" "minio") }}
{{- end }}

{{/* The Secret with `accesskey`/`secretkey`: the user's, else the bundled MinIO's, else none. */}}
{{- define "kernelfleet.storeSecret" -}}
{{- if .Values.store.existingSecret }}
{{- .Values.store.existingSecret }}
{{- else if .Values.minio.enabled }}
{{- include "kernelfleet.minioName" . }}
{{- end }}
{{- end }}

{{- define "kernelfleet.storeUrl" -}}
{{- if .Values.store.url }}
{{- .Values.store.url }}
{{- else if .Values.minio.enabled }}
{{- printf "s3://%s" .Values.minio.bucket }}
{{- end }}
{{- end }}

{{- define "kernelfleet.storeEndpoint" -}}
{{- if .Values.store.endpoint }}
{{- .Values.store.endpoint }}
{{- else if .Values.minio.enabled }}
{{- printf "%s.%s.svc:9000" (include "kernelfleet.minioName" .) .Release.Namespace }}
{{- end }}
{{- end }}

{{/* The bundled MinIO serves plain HTTP; any other endpoint follows store.secure. */}}
{{- define "kernelfleet.storeSecure" -}}
{{- if and .Values.minio.enabled (not .Values.store.endpoint) }}false{{ else }}{{ .Values.store.secure }}{{ end }}
{{- end }}

{{/* Where the store Secret is mounted in the operator; KERNELFLEET_S3_CREDENTIALS_DIR points here. */}}
{{- define "kernelfleet.storeCredentialsDir" -}}
/var/run/secrets/kernelfleet/store
{{- end }}

{{/* ------------------------------------------------------------------ GPU pools */}}

{{/*
One pool class with the defaults filled in; call with (dict "root" $ "name" "h100").
The operator gets every field resolved, so it never merges defaults itself.
*/}}
{{- define "kernelfleet.poolClass" -}}
{{- $pools := .root.Values.pools }}
{{- $class := get $pools.classes .name }}
{{- if not (kindIs "map" $class) }}
{{- fail (printf "pools.classes.%s is not a pool class (a map with `products` or `nodeSelector`); the classes are: %s" .name (keys $pools.classes | sortAlpha | join ", ")) }}
{{- end }}
{{- $products := default (list) $class.products }}
{{- $nodeSelector := default (dict) $class.nodeSelector }}
{{- if and (empty $products) (empty $nodeSelector) }}
{{- fail (printf "pools.classes.%s selects no nodes: give it `products` (values of the node label %s) or a `nodeSelector`" .name (default $pools.nodeLabel $class.nodeLabel)) }}
{{- end }}
{{- $resolved := dict
    "nodeLabel" (default $pools.nodeLabel $class.nodeLabel)
    "products" $products
    "nodeSelector" $nodeSelector
    "tolerations" (ternary $class.tolerations $pools.tolerations (hasKey $class "tolerations"))
    "gpuResource" (default $pools.gpuResource $class.gpuResource)
    "requests" (merge (dict) (default (dict) $class.requests) (default (dict) $pools.requests)) }}
{{- toYaml $resolved }}
{{- end }}

{{/* The whole pools.yaml document that the operator reads. */}}
{{- define "kernelfleet.poolsYaml" -}}
{{- $classes := dict }}
{{- range $name := keys .Values.pools.classes | sortAlpha }}
{{- $_ := set $classes $name (include "kernelfleet.poolClass" (dict "root" $ "name" $name) | fromYaml) }}
{{- end }}
{{- if empty $classes }}
{{- fail "pools.classes is empty: the operator needs at least one GPU class (see values.yaml for the defaults)" }}
{{- end }}
{{- toYaml (dict "version" 1 "classes" $classes) }}
{{- end }}

{{/*
Node affinity and tolerations that put a pod on a pool class's nodes, for the servers this chart
runs itself (vLLM); call with (dict "root" $ "name" "h100").
*/}}
{{- define "kernelfleet.poolPlacement" -}}
{{- $class := include "kernelfleet.poolClass" . | fromYaml }}
{{- if $class.nodeSelector }}
nodeSelector:
  {{- toYaml $class.nodeSelector | nindent 2 }}
{{- end }}
{{- if $class.products }}
affinity:
  nodeAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      nodeSelectorTerms:
        - matchExpressions:
            - key: {{ $class.nodeLabel | quote }}
              operator: In
              values:
                {{- toYaml $class.products | nindent 16 }}
{{- end }}
{{- with $class.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* ------------------------------------------------------------------ vLLM */}}

{{- define "kernelfleet.vllmName" -}}
{{- include "kernelfleet.componentName" (dict "root" . "component" "vllm") }}
{{- end }}

{{- define "kernelfleet.vllmServedModel" -}}
{{- default .Values.vllm.model .Values.vllm.servedModelName }}
{{- end }}
