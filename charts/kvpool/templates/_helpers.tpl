{{/* Names, labels and shared snippets. */}}
{{- define "kvpool.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvpool.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvpool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The selector labels as k=v,k=v (the operator's --operator-pod-labels). */}}
{{- define "kvpool.selectorLabelList" -}}
{{- $out := list -}}
{{- range $k, $v := include "kvpool.selectorLabels" . | fromYaml -}}
{{- $out = append $out (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{- define "kvpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvpool.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "kvpool.webhookName" -}}
{{- printf "%s-webhook" (include "kvpool.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvpool.certSecretName" -}}
{{- default (printf "%s-webhook-cert" (include "kvpool.fullname" .)) .Values.webhook.certSecret -}}
{{- end -}}

{{/*
The webhook's serving cert and CA: a given Secret + caBundle, or generated once and reused on
upgrades (lookup), so that the Secret and the MutatingWebhookConfiguration always agree.
Returns YAML {crt, key, ca} (base64), computed once per render.
*/}}
{{- define "kvpool.webhookCert" -}}
{{- if not .Values.webhook.certSecret -}}
{{- $name := include "kvpool.certSecretName" . -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace $name -}}
{{- if and $existing (index $existing.data "ca.crt") -}}
crt: {{ index $existing.data "tls.crt" }}
key: {{ index $existing.data "tls.key" }}
ca: {{ index $existing.data "ca.crt" }}
{{- else -}}
{{- $svc := include "kvpool.webhookName" . -}}
{{- $ns := .Release.Namespace -}}
{{- $ca := genCA (printf "%s-ca" $svc) 3650 -}}
{{- $dns := list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns) -}}
{{- $cert := genSignedCert (printf "%s.%s.svc" $svc $ns) nil $dns 3650 $ca -}}
crt: {{ $cert.Cert | b64enc }}
key: {{ $cert.Key | b64enc }}
ca: {{ $ca.Cert | b64enc }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Namespaced rules of the operator (cluster-wide or per watched namespace). */}}
{{- define "kvpool.namespacedRules" -}}
- apiGroups: [kvpool.io]
  resources: [kvpools]
  verbs: [get, list, watch, patch, update]
- apiGroups: [kvpool.io]
  resources: [kvpools/status]
  verbs: [get, patch, update]
- apiGroups: [apps]
  resources: [statefulsets, deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services, configmaps, serviceaccounts, secrets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch]
# A NetworkPolicy per pool (created, updated and pruned with it; watched for drift). Switched
# off, the operator only deletes those it made before.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: {{ ternary "[get, list, watch, create, patch, delete]" "[delete]" .Values.networkPolicy.enabled }}
{{- end -}}
