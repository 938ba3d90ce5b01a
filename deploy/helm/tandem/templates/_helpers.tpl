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

{{/* The NATS URL every component uses: the bundled server over TLS (tls://) unless TLS is off. */}}
{{- define "tandem.natsUrl" -}}
{{- if .Values.nats.bundled -}}
{{- printf "%s://%s.%s.svc:4222" (ternary "tls" "nats" .Values.nats.tls.enabled) (include "tandem.nats.name" .) .Release.Namespace -}}
{{- else -}}
{{- .Values.nats.url -}}
{{- end -}}
{{- end -}}

{{- define "tandem.nats.name" -}}
{{- include "tandem.name" (dict "root" . "component" "nats") -}}
{{- end -}}

{{/* Secret with the bundled server's certificate, key and CA (generated or cert-manager's). */}}
{{- define "tandem.nats.tlsSecret" -}}
{{- printf "%s-tls" (include "tandem.nats.name" .) -}}
{{- end -}}

{{/* Secret the install hook fills: server.conf (accounts + auth_callout), issuer.nk, auth.nk. */}}
{{- define "tandem.nats.authSecret" -}}
{{- printf "%s-nats-auth" (include "tandem.fullname" .) -}}
{{- end -}}

{{- define "tandem.callout" -}}
{{- if eq .Values.nats.auth.mode "callout" }}true{{ end -}}
{{- end -}}

{{/* The Secret and key of the CA the clients verify NATS with ("" when none: system CAs). */}}
{{- define "tandem.nats.caSecret" -}}
{{- if and .Values.nats.bundled .Values.nats.tls.enabled -}}
{{- include "tandem.nats.tlsSecret" . -}}
{{- else if not .Values.nats.bundled -}}
{{- .Values.nats.tls.caSecret.name -}}
{{- end -}}
{{- end -}}

{{- define "tandem.nats.caKey" -}}
{{- if .Values.nats.bundled }}ca.crt{{ else }}{{ .Values.nats.tls.caSecret.key }}{{ end -}}
{{- end -}}

{{/* Service account of a component; the auth callout maps these names to roles. */}}
{{- define "tandem.serviceAccountName" -}}
{{- include "tandem.name" . -}}
{{- end -}}

{{/* service account -> Tandem role, as the callout's auth_identities (same names as rendered). */}}
{{- define "tandem.authIdentities" -}}
{{- range $role := list "allocator" "inventory" "admission" "nodeagent" "cli" }}
{{ include "tandem.serviceAccountName" (dict "root" $ "component" $role) }}: {{ $role }}
{{- end }}
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

{{/* Config file, NATS credentials and environment of a Tandem container (.root, .component).
Credentials are per component: its own projected service-account token (auth callout), or its
own key of the credentials Secret; the callout itself logs in as the AUTH account's nkey user. */}}
{{- define "tandem.env" -}}
{{- $v := .root.Values -}}
- name: TANDEM_CONFIG
  value: /etc/tandem/config/tandem.yaml
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: TANDEM_INSTANCE
  value: $(POD_NAME)
{{- if eq .component "authcallout" }}
- name: TANDEM_NATS_NKEY_SEED
  value: /etc/tandem/nats-auth/auth.nk
- name: TANDEM_AUTH_ISSUER_SEED_FILE
  value: /etc/tandem/nats-auth/issuer.nk
{{- else if eq $v.nats.auth.mode "callout" }}
- name: TANDEM_NATS_TOKEN_FILE
  value: /var/run/secrets/tandem.io/nats/token
{{- else if eq $v.nats.auth.mode "creds" }}
- name: TANDEM_NATS_CREDS
  value: /etc/tandem/nats/{{ .component }}.creds
{{- end }}
{{- end -}}

{{- define "tandem.volumeMounts" -}}
{{- $v := .root.Values -}}
- name: config
  mountPath: /etc/tandem/config
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if include "tandem.nats.caSecret" .root }}
- name: nats-ca
  mountPath: /etc/tandem/nats-ca
  readOnly: true
{{- end }}
{{- if eq .component "authcallout" }}
- name: nats-auth
  mountPath: /etc/tandem/nats-auth
  readOnly: true
{{- else if eq $v.nats.auth.mode "callout" }}
- name: nats-token
  mountPath: /var/run/secrets/tandem.io/nats
  readOnly: true
{{- else if eq $v.nats.auth.mode "creds" }}
- name: nats-creds
  mountPath: /etc/tandem/nats
  readOnly: true
{{- end }}
{{- end -}}

{{- define "tandem.volumes" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
- name: config
  configMap:
    name: {{ include "tandem.fullname" $root }}-config
- name: tmp
  emptyDir: {}
{{- with include "tandem.nats.caSecret" $root }}
# Only the CA: the server's key stays with the server.
- name: nats-ca
  secret:
    secretName: {{ . }}
    items:
      - key: {{ include "tandem.nats.caKey" $root }}
        path: ca.crt
{{- end }}
{{- if eq .component "authcallout" }}
# The issuer seed and the callout's own user seed; not server.conf.
- name: nats-auth
  secret:
    secretName: {{ include "tandem.nats.authSecret" $root }}
    defaultMode: 0440
    items:
      - {key: issuer.nk, path: issuer.nk}
      - {key: auth.nk, path: auth.nk}
{{- else if eq $v.nats.auth.mode "callout" }}
# A token of this pod's own service account, bound to the pod (and so to its node), for NATS only.
- name: nats-token
  projected:
    sources:
      - serviceAccountToken:
          audience: {{ $v.nats.auth.audience }}
          expirationSeconds: {{ $v.nats.auth.tokenExpirationSeconds }}
          path: token
{{- else if eq $v.nats.auth.mode "creds" }}
- name: nats-creds
  secret:
    secretName: {{ $v.nats.auth.credentialsSecret.name }}
    defaultMode: 0440
    items:
      - key: {{ .component }}.creds
        path: {{ .component }}.creds
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
      serviceAccountName: {{ include "tandem.serviceAccountName" . }}
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
            {{- include "tandem.env" . | nindent 12 }}
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
            {{- include "tandem.volumeMounts" . | nindent 12 }}
            {{- with .extraMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "tandem.volumes" . | nindent 8 }}
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
