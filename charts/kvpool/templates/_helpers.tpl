{{/* The chart's name (nameOverride wins). */}}
{{- define "kvpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The prefix of every object's name: the release name, with the chart's name unless the
release name already holds it. */}}
{{- define "kvpool.fullname" -}}
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

{{/* The operator's objects: the full name with -operator (at most 63 characters). */}}
{{- define "kvpool.operatorName" -}}
{{- printf "%s-operator" (include "kvpool.fullname" . | trunc 54 | trimSuffix "-") }}
{{- end }}

{{/* The webhook's Service (and its RBAC): the operator's name with -webhook (at most 63
characters, a DNS label as --webhook-service wants). */}}
{{- define "kvpool.webhookName" -}}
{{- printf "%s-webhook" (include "kvpool.operatorName" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{/* Where the operator's container mounts webhook.certSecretName. */}}
{{- define "kvpool.webhookCertDir" -}}
/etc/kvpool/webhook-tls
{{- end }}

{{/* Labels of every object of the chart (the templates add app.kubernetes.io/component). */}}
{{- define "kvpool.commonLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels of the operator's objects. */}}
{{- define "kvpool.labels" -}}
{{ include "kvpool.commonLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The labels the operator's Deployment selects its pod by. */}}
{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The operator's ServiceAccount. */}}
{{- define "kvpool.serviceAccountName" -}}
{{- default (include "kvpool.operatorName" .) .Values.serviceAccount.name }}
{{- end }}

{{/* The image: repository:tag, or repository@digest when a digest is set. */}}
{{- define "kvpool.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s:%s@%s" .Values.image.repository $tag .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* The namespace of the example pool. */}}
{{- define "kvpool.examplePoolNamespace" -}}
{{- default .Release.Namespace .Values.examplePool.namespace }}
{{- end }}
