{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "kubeinfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: the release name, with the chart name appended unless it already contains it. */}}
{{- define "kubeinfer.fullname" -}}
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

{{- define "kubeinfer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kubeinfer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubeinfer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kubeinfer.labels" -}}
helm.sh/chart: {{ include "kubeinfer.chart" . }}
{{ include "kubeinfer.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubeinfer
{{- end }}

{{- define "kubeinfer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kubeinfer.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
An image reference with global.imageRegistry in place of its registry: (list REF REGISTRY).
The first path component is a registry when it has a dot or a port, or is "localhost" (the
container runtime's rule); Docker Hub references have none and just get the prefix.
*/}}
{{- define "kubeinfer.withRegistry" -}}
{{- $ref := index . 0 }}
{{- $registry := trimSuffix "/" (index . 1 | default "") }}
{{- if $registry }}
{{- $parts := splitList "/" $ref }}
{{- $first := first $parts }}
{{- if and (gt (len $parts) 1) (or (contains "." $first) (contains ":" $first) (eq $first "localhost")) }}
{{- printf "%s/%s" $registry (join "/" (rest $parts)) }}
{{- else }}
{{- printf "%s/%s" $registry $ref }}
{{- end }}
{{- else }}
{{- $ref }}
{{- end }}
{{- end }}

{{- define "kubeinfer.globalRegistry" -}}
{{- (.Values.global | default dict).imageRegistry | default "" }}
{{- end }}

{{- define "kubeinfer.image" -}}
{{- $ref := printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- include "kubeinfer.withRegistry" (list $ref (include "kubeinfer.globalRegistry" .)) }}
{{- end }}

{{/* Default image of the model servers the operator creates (KUBEINFER_DEFAULT_SERVER_IMAGE). */}}
{{- define "kubeinfer.serverImage" -}}
{{- $ref := printf "%s:%s" .Values.server.image.repository (default .Chart.AppVersion .Values.server.image.tag) }}
{{- include "kubeinfer.withRegistry" (list $ref (include "kubeinfer.globalRegistry" .)) }}
{{- end }}

{{/* Default image of the model servers without GPUs (resources.gpu.count 0): the CPU build of
Dockerfile.server (KUBEINFER_DEFAULT_SERVER_CPU_IMAGE). */}}
{{- define "kubeinfer.serverCpuImage" -}}
{{- $ref := printf "%s:%s" .Values.server.cpuImage.repository (default (printf "%s-cpu" .Chart.AppVersion) .Values.server.cpuImage.tag) }}
{{- include "kubeinfer.withRegistry" (list $ref (include "kubeinfer.globalRegistry" .)) }}
{{- end }}

{{/* Default image of the per-model routers (KUBEINFER_DEFAULT_ROUTER_IMAGE). */}}
{{- define "kubeinfer.routerImage" -}}
{{- $ref := printf "%s:%s" .Values.router.image.repository .Values.router.image.tag }}
{{- include "kubeinfer.withRegistry" (list $ref (include "kubeinfer.globalRegistry" .)) }}
{{- end }}

{{- define "kubeinfer.endpointPickerImage" -}}
{{- $ref := printf "%s:%s" .Values.inferenceExtension.endpointPicker.image.repository .Values.inferenceExtension.endpointPicker.image.tag }}
{{- include "kubeinfer.withRegistry" (list $ref (include "kubeinfer.globalRegistry" .)) }}
{{- end }}

{{/* global.imagePullSecrets then imagePullSecrets, each name once. */}}
{{- define "kubeinfer.operatorPullSecrets" -}}
{{- $names := list }}
{{- range (concat ((.Values.global | default dict).imagePullSecrets | default list) (.Values.imagePullSecrets | default list)) }}
{{- $names = append $names .name }}
{{- end }}
{{- range (uniq $names) }}
- name: {{ . }}
{{- end }}
{{- end }}

{{/* Names of global.imagePullSecrets, comma-separated (KUBEINFER_DEFAULT_IMAGE_PULL_SECRETS). */}}
{{- define "kubeinfer.modelPullSecrets" -}}
{{- $names := list }}
{{- range ((.Values.global | default dict).imagePullSecrets | default list) }}
{{- $names = append $names .name }}
{{- end }}
{{- join "," (uniq $names) }}
{{- end }}

{{/* Name of the leader election Lease. */}}
{{- define "kubeinfer.leaseName" -}}
{{- default (include "kubeinfer.fullname" .) .Values.operator.leaderElection.leaseName }}
{{- end }}

{{/* True (non-empty) when more than one operator replica runs with leader election. */}}
{{- define "kubeinfer.ha" -}}
{{- if and .Values.operator.leaderElection.enabled (gt (int .Values.operator.replicas) 1) }}true{{- end }}
{{- end }}

{{/* True (non-empty) when the operator watches every namespace. */}}
{{- define "kubeinfer.clusterWide" -}}
{{- if not .Values.operator.watchNamespaces }}true{{- end }}
{{- end }}

{{/* The Secret holding the management key (operator.managementKey). */}}
{{- define "kubeinfer.managementSecretName" -}}
{{- .Values.operator.managementKey.existingSecret | default (printf "%s-management" (include "kubeinfer.fullname" .)) -}}
{{- end }}
