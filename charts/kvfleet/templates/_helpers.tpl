{{/* Names: every object is prefixed with the release's full name. */}}
{{- define "kvfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvfleet.labels" -}}
app.kubernetes.io/name: kvfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvfleet.selector" -}}
app.kubernetes.io/name: kvfleet
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvfleet.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end -}}

{{- define "kvfleet.eppName" -}}{{ include "kvfleet.fullname" . }}-epp{{- end -}}
{{- /* Pick gossip between EPP replicas (kvfleet/epp/gossip.py): on with more than one replica ("true" or empty). */ -}}
{{- define "kvfleet.gossip" -}}{{ if gt (int .Values.epp.replicas) 1 }}true{{ end }}{{- end -}}
{{- define "kvfleet.gossipPort" -}}{{- $p := dig "epp" "gossip_port" 0 .Values.config | int -}}{{ if eq $p 0 }}9004{{ else }}{{ $p }}{{ end }}{{- end -}}
{{/* The transfer Secret every pod reads: transfer.secret.existingSecret when given (the chart then renders none), else the chart's. */}}
{{- define "kvfleet.transferSecret" -}}{{ .Values.transfer.secret.existingSecret | default (printf "%s-transfer" (include "kvfleet.fullname" .)) }}{{- end -}}

{{/* The kvfleet config.yaml: values.config with the release's object names written in. */}}
{{- define "kvfleet.config" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $op := default dict $cfg.operator -}}
{{- $_ := set $op "image" (include "kvfleet.image" .) -}}
{{- $_ := set $op "image_pull_policy" .Values.image.pullPolicy -}}
{{- $_ := set $op "epp_service" (include "kvfleet.eppName" .) -}}
{{- $_ := set $op "transfer_secret" (include "kvfleet.transferSecret" .) -}}
{{- $_ := set $op "epp_port" (dig "epp" "grpc_port" 9002 $cfg) -}}
{{- $_ := set $cfg "operator" $op -}}
{{- if hasKey $cfg "epp" -}}
{{- $_ := set $cfg.epp "namespace" .Release.Namespace -}}
{{- /* in a cluster the EPP watches InferencePools and their Pods */ -}}
{{- $_ := set $cfg.epp "datastore" "kubernetes" -}}
{{- $_ := set $cfg.epp "service_name" (include "kvfleet.eppName" .) -}}
{{- if include "kvfleet.gossip" . -}}
{{- /* several replicas share their picks (kvfleet/epp/gossip.py): peers are every replica's address, the messages signed with the transfer secret */ -}}
{{- $port := include "kvfleet.gossipPort" . | int -}}
{{- $_ := set $cfg.epp "gossip_port" $port -}}
{{- $_ := set $cfg.epp "gossip_peers" (list (printf "%s-replicas.%s.svc:%d" (include "kvfleet.eppName" .) .Release.Namespace $port)) -}}
{{- $_ := set $cfg.epp "gossip_secret_file" "/etc/kvfleet-gossip/secret" -}}
{{- end -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Pod level, Pod Security "restricted": non-root, the runtime's default seccomp profile. */}}
{{- define "kvfleet.podSecurityContext" -}}
runAsNonRoot: true
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* PodDisruptionBudget spec: at most podDisruptionBudget.maxUnavailable of a Deployment's pods evicted at once. */}}
{{- define "kvfleet.pdb" -}}
{{- $ := index . 0 -}}
{{- $component := index . 1 -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ index . 2 }}
  namespace: {{ $.Release.Namespace }}
  labels:
    {{- include "kvfleet.labels" $ | nindent 4 }}
    app.kubernetes.io/component: {{ $component }}
spec:
  maxUnavailable: {{ $.Values.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "kvfleet.selector" $ | nindent 6 }}
      app.kubernetes.io/component: {{ $component }}
{{- end -}}

{{- define "kvfleet.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- /* gateway.provider: "kvfleet" runs the chart's own Envoy; a Gateway API implementation gets the Gateway
API objects (Gateway, HTTPRoutes to InferencePools) and calls the EPP named by each InferencePool itself. */ -}}
{{- define "kvfleet.ownEnvoy" -}}{{ if eq .Values.gateway.provider "kvfleet" }}true{{ end }}{{- end -}}
{{- define "kvfleet.gatewayApi" -}}{{ if has .Values.gateway.provider (list "envoy-gateway" "istio" "kgateway" "gke") }}true{{ end }}{{- end -}}
{{- define "kvfleet.gatewayClass" -}}
{{- $defaults := dict "envoy-gateway" "envoy-gateway" "istio" "istio" "kgateway" "kgateway" "gke" "gke-l7-regional-external-managed" -}}
{{- .Values.gateway.gatewayClassName | default (get $defaults .Values.gateway.provider) -}}
{{- end -}}
