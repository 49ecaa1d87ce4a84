{{/* The chart's name, or nameOverride. */}}
{{- define "outbox-operator.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's base name: fullnameOverride, else the release name, with the chart's name unless it already holds it. */}}
{{- define "outbox-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := include "outbox-operator.name" . }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The manager's service account: the one the chart creates, or serviceAccount.name. */}}
{{- define "outbox-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- .Values.serviceAccount.name | default (include "outbox-operator.fullname" .) }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
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

{{/* Labels that select the manager pods; the same as config/manager's (the alerts find the manager as job="outbox-operator"). */}}
{{- define "outbox-operator.selectorLabels" -}}
app.kubernetes.io/name: outbox-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: manager
{{- end }}

{{/*
The operator image: repository@digest, or repository:tag (tag defaults to
appVersion). A development chart (appVersion ending in -dev: the chart of a
source checkout, which `make release` stamps with the release's version) has
no released image of its own, and an older release ignores the fields its
CRD added: it renders only with image.tag or image.digest. A tag naming an
older release (vX.Y.Z before appVersion) is refused for the same reason: a
values file kept from that release's upgrade pins it.
*/}}
{{- define "outbox-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else if .Values.image.tag }}
{{- $tag := .Values.image.tag | trimPrefix "v" }}
{{- $chart := regexReplaceAll "-.*$" (.Chart.AppVersion | trimPrefix "v") "" }}
{{- if and (regexMatch "^[0-9]+\\.[0-9]+\\.[0-9]+$" $tag) (semverCompare (printf "<%s" $chart) $tag) }}
{{- fail (printf "image.tag %s is an older operator release than this chart's (v%s): it ignores the fields this chart's CRD added, and the chart's arguments may be new to it. Drop image.tag (a values file kept from that release pins it) to run the chart's own release, or set v%s or later" .Values.image.tag $chart $chart) }}
{{- end }}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- else if hasSuffix "-dev" .Chart.AppVersion }}
{{- fail (printf "this chart is a development version (%s, from a source checkout): no released operator image matches its CRD, and an older one ignores the fields it added. Set image.tag or image.digest to an operator image built from the same commit (make images), or install a released chart" .Chart.Version) }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository .Chart.AppVersion }}
{{- end }}
{{- end }}

{{/* The manager's RBAC rules, generated from the +kubebuilder:rbac markers (config/rbac/role.yaml). */}}
{{- define "outbox-operator.managerRules" -}}
{{- (.Files.Get "files/role.yaml" | fromYaml).rules | toYaml }}
{{- end }}

{{/* The rules of a ClusterRole kept under config/rbac (files/<name>.yaml). */}}
{{- define "outbox-operator.rulesOf" -}}
{{- (.root.Files.Get (printf "files/%s.yaml" .file) | fromYaml).rules | toYaml }}
{{- end }}

{{/* The Secret keeping the manager's digest key (config/manager/digest_key.yaml). */}}
{{- define "outbox-operator.digestKeySecret" -}}
{{- printf "%s-digest-key" (include "outbox-operator.fullname" .) }}
{{- end }}

{{/* The metrics Service's name: a Service's name is at most 63 characters, suffix included. */}}
{{- define "outbox-operator.metricsService" -}}
{{- printf "%s-metrics" (include "outbox-operator.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{/*
Whether Prometheus scrapes /metrics without verifying its certificate: only
when monitoring.serviceMonitor.tlsConfig asks for it (insecureSkipVerify: true).
*/}}
{{- define "outbox-operator.metricsInsecure" -}}
{{- if (.Values.monitoring.serviceMonitor.tlsConfig | default dict).insecureSkipVerify }}true{{ end }}
{{- end }}

{{/*
Whether the chart issues the certificate /metrics serves: the ServiceMonitor
scrapes over HTTPS and verifies it, and metrics.certSecret names none.
*/}}
{{- define "outbox-operator.metricsCertIssued" -}}
{{- $sm := .Values.monitoring.serviceMonitor }}
{{- if and $sm.enabled .Values.metrics.enabled .Values.metrics.secure (not .Values.metrics.certSecret) (not (include "outbox-operator.metricsInsecure" .)) }}true{{ end }}
{{- end }}

{{/* The Secret whose certificate /metrics serves: metrics.certSecret, the chart's own, or none (self-signed at start). */}}
{{- define "outbox-operator.metricsCertSecret" -}}
{{- if .Values.metrics.certSecret }}
{{- .Values.metrics.certSecret }}
{{- else if include "outbox-operator.metricsCertIssued" . }}
{{- printf "%s-metrics-cert" (include "outbox-operator.fullname" .) }}
{{- end }}
{{- end }}
