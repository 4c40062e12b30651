{{/* Chart name, overridable. */}}
{{- define "distflow.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every object name: <release>-distflow, or the release name when it already says distflow. */}}
{{- define "distflow.fullname" -}}
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

{{/* Labels on every object the chart creates (helm uninstall finds them by these). */}}
{{- define "distflow.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "distflow.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: distflow
{{- end }}

{{/* The operator pod's identity; the Deployment selector and the metrics Service use it. */}}
{{- define "distflow.selectorLabels" -}}
app.kubernetes.io/name: {{ include "distflow.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "distflow.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "distflow.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: set the existing ServiceAccount to use when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "distflow.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The operator's grant in a watched namespace. Keep in step with
distflow_operator/rbac.py OPERATOR_RULES (tests/operator/test_helm.py compares them):
no update anywhere, no patch on jobs, no Secrets.
*/}}
{{- define "distflow.operatorRules" -}}
- apiGroups: [distflow.io]
  resources: [rlposttrainjobs]
  verbs: [get, list, watch, delete]
- apiGroups: [distflow.io]
  resources: [rlposttrainjobs/status]
  verbs: [get, patch]
- apiGroups: [distflow.io]
  resources: [rlposttrainjobs/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if eq .Values.batchScheduler "volcano" }}
- apiGroups: [scheduling.volcano.sh]
  resources: [podgroups]
  verbs: [get, create, patch]
{{- else if eq .Values.batchScheduler "scheduler-plugins" }}
- apiGroups: [scheduling.x-k8s.io]
  resources: [podgroups]
  verbs: [get, create, patch]
{{- end }}
{{- end }}

{{/*
Leader election, in the release namespace only. Keep in step with rbac.py LEADER_ELECTION_RULES.
RBAC cannot restrict create by name (the name is not in the request's URL), so create is granted
for Leases of this namespace and get/update for the operator's Lease alone.
*/}}
{{- define "distflow.leaderElectionRules" -}}
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [create]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  resourceNames: [distflow-operator]
  verbs: [get, update]
{{- end }}

{{/* What kopf needs cluster-wide to follow namespaces and CRDs when it watches them all. */}}
{{- define "distflow.discoveryRules" -}}
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end }}
