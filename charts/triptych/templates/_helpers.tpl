{{- define "triptych.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "triptych.labels" -}}
app.kubernetes.io/name: triptych
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "triptych.selectorLabels" -}}
app.kubernetes.io/name: triptych
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "triptych.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "triptych.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaced permissions: pipelines, their children, and events. */}}
{{- define "triptych.namespacedRules" -}}
- apiGroups: [triptych.ai]
  resources: [diffusionpipelines]
  # kopf records handler progress in annotations (patch).
  verbs: [get, list, watch, patch]
- apiGroups: [triptych.ai]
  resources: [diffusionpipelines/status]
  verbs: [get, patch]
- apiGroups: [triptych.ai]
  resources: [diffusionpipelines/finalizers]
  # Children carry blockOwnerDeletion owner references; clusters with the
  # OwnerReferencesPermissionEnforcement admission plugin require this to set them.
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  # Server-side apply creates and patches; a role's pool is deleted when the pipeline switches
  # encoder shape (deleting the pipeline leaves the rest to garbage collection).
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments/scale]
  # Roles that scale to zero (autoscaling.minReplicas 0): taken to 0 when idle, back up when needed
  # (their replicas are read from the Deployments' watch).
  verbs: [patch]
- apiGroups: [custom.metrics.k8s.io]
  resources: [deployments.apps/triptych_pending_work_seconds]
  # The signal of those roles, read as their HPA reads it.
  verbs: [get]
- apiGroups: [""]
  resources: [services]
  # A role's headless Service goes with its pool when the pipeline switches encoder shape.
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  # Read only: why a component is not ready (unschedulable, crash-looping) goes into the status.
  verbs: [get, list, watch]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  # Deleted when a role's autoscaling is turned off.
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [ingresses]
  # Deleted when the head's ingress is turned off.
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  # The heads' budget while there are several; deleted when one head is left.
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [configmaps]
  # spec.model.loras as the head's and denoisers' adapter catalogue; deleted when the list is emptied.
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  # Who may reach the workers' and head's control and transfer ports.
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [secrets]
  # Each pipeline's control-plane keys: created once, read back for their fingerprint, never changed.
  verbs: [get, create]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- if gt (int .Values.replicas) 1 }}
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  # High availability: the replicas' keep-alives and who is active (kopf peering).
  verbs: [get, list, watch, patch]
{{- end }}
{{- end -}}

{{/* The custom metrics API server (triptych-metrics-api): its own name, labels and account. */}}
{{- define "triptych.metricsApi.fullname" -}}
{{- printf "%s-metrics-api" (include "triptych.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "triptych.metricsApi.labels" -}}
{{ include "triptych.labels" . | replace "app.kubernetes.io/component: operator" "app.kubernetes.io/component: metrics-api" }}
{{- end -}}

{{- define "triptych.metricsApi.selectorLabels" -}}
app.kubernetes.io/name: triptych
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: metrics-api
{{- end -}}

{{/* The metrics the HPA may read: each served metric as a subresource of deployments.apps (no wildcard). */}}
{{- define "triptych.metricsApi.metricResources" -}}
- deployments.apps/triptych_pending_work_seconds
- deployments.apps/triptych_queued_requests
- deployments.apps/triptych_running_requests
- deployments.apps/triptych_ready_instances
{{- end -}}
