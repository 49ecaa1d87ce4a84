{{/* The chart's name. */}}
{{- define "outbox-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's base name: the release name, with the chart's name unless it already holds it. */}}
{{- define "outbox-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "outbox-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "outbox-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: outbox-operator
{{- end }}

{{/* Labels that select the manager pods; the same as config/manager's. */}}
{{- define "outbox-operator.selectorLabels" -}}
app.kubernetes.io/name: outbox-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: manager
{{- end }}

{{/* The operator image: repository@digest, or repository:tag (tag defaults to appVersion). */}}
{{- define "outbox-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/* The manager's RBAC rules, generated from the +kubebuilder:rbac markers (config/rbac/role.yaml). */}}
{{- define "outbox-operator.managerRules" -}}
{{- (.Files.Get "files/role.yaml" | fromYaml).rules | toYaml }}
{{- end }}
