{{/* Names: <release>-tandem-<component>, cut to 63 characters. */}}
{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem.name" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: tandem
{{ include "tandem.selectorLabels" . }}
{{- end -}}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: tandem
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The NATS URL every component uses. */}}
{{- define "tandem.natsUrl" -}}
{{- if .Values.nats.bundled -}}
{{- printf "nats://%s.%s.svc:4222" (include "tandem.name" (dict "root" . "component" "nats")) .Release.Namespace -}}
{{- else -}}
{{- .Values.nats.url -}}
{{- end -}}
{{- end -}}

{{- define "tandem.streamReplicas" -}}
{{- if .Values.nats.bundled -}}{{ min 3 .Values.nats.replicas }}{{- else -}}{{ .Values.nats.streamReplicas }}{{- end -}}
{{- end -}}

{{- define "tandem.admission.service" -}}
{{- include "tandem.name" (dict "root" . "component" "admission") -}}
{{- end -}}

{{- define "tandem.admission.tlsSecret" -}}
{{- printf "%s-tls" (include "tandem.admission.service" .) -}}
{{- end -}}

{{/* Restricted pod security for every component but the node agent. */}}
{{- define "tandem.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "tandem.containerSecurityContext" -}}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* Config file, NATS credentials and environment shared by the Tandem containers. */}}
{{- define "tandem.env" -}}
- name: TANDEM_CONFIG
  value: /etc/tandem/config/tandem.yaml
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: TANDEM_INSTANCE
  value: $(POD_NAME)
{{- if .Values.nats.credentialsSecret.name }}
- name: TANDEM_NATS_CREDS
  value: /etc/tandem/nats/{{ .Values.nats.credentialsSecret.key }}
{{- end }}
{{- end -}}

{{- define "tandem.volumeMounts" -}}
- name: config
  mountPath: /etc/tandem/config
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .Values.nats.credentialsSecret.name }}
- name: nats-creds
  mountPath: /etc/tandem/nats
  readOnly: true
{{- end }}
{{- end -}}

{{- define "tandem.volumes" -}}
- name: config
  configMap:
    name: {{ include "tandem.fullname" . }}-config
- name: tmp
  emptyDir: {}
{{- if .Values.nats.credentialsSecret.name }}
- name: nats-creds
  secret:
    secretName: {{ .Values.nats.credentialsSecret.name }}
{{- end }}
{{- end -}}

{{- define "tandem.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- end -}}

{{/* A Deployment of one Python service: .component, .module, .values, .args, .ports, .probes, .extra */}}
{{- define "tandem.deployment" -}}
{{- $root := .root -}}
{{- $v := .values -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "tandem.name" . }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | nindent 4 }}
spec:
  replicas: {{ $v.replicas }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "tandem.selectorLabels" . | nindent 8 }}
      annotations:
        {{- include "tandem.configChecksum" $root | nindent 8 }}
    spec:
      serviceAccountName: {{ include "tandem.name" . }}
      automountServiceAccountToken: {{ .kubeApi | default false }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- include "tandem.podSecurityContext" $root | nindent 8 }}
      containers:
        - name: {{ .component }}
          image: {{ include "tandem.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["python", "-m", "services.{{ .module }}"]
          {{- with .args }}
          args:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          env:
            {{- include "tandem.env" $root | nindent 12 }}
          {{- with .ports }}
          ports:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $v.livenessProbe }}
          livenessProbe:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $v.readinessProbe }}
          readinessProbe:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          resources:
            {{- toYaml $v.resources | nindent 12 }}
          securityContext:
            {{- include "tandem.containerSecurityContext" $root | nindent 12 }}
          volumeMounts:
            {{- include "tandem.volumeMounts" $root | nindent 12 }}
            {{- with .extraMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "tandem.volumes" $root | nindent 8 }}
        {{- with .extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $v.affinity }}
      affinity:
        {{- toYaml $v.affinity | nindent 8 }}
      {{- else if gt (int $v.replicas) 1 }}
      affinity:
        podAntiAffinity:
          preferredDuringSchedulingIgnoredDuringExecution:
            - weight: 100
              podAffinityTerm:
                topologyKey: kubernetes.io/hostname
                labelSelector:
                  matchLabels:
                    {{- include "tandem.selectorLabels" . | nindent 20 }}
      {{- end }}
{{- end -}}

{{- define "tandem.pdb" -}}
{{- if and .values.podDisruptionBudget.enabled (gt (int .values.replicas) 1) }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "tandem.name" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | nindent 4 }}
spec:
  minAvailable: {{ .values.podDisruptionBudget.minAvailable }}
  selector:
    matchLabels:
      {{- include "tandem.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{- define "tandem.serviceAccount" -}}
apiVersion: v1
kind: ServiceAccount
metadata:
  name: {{ include "tandem.name" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "tandem.labels" . | nindent 4 }}
automountServiceAccountToken: false
{{- end -}}
