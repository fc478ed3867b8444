{{- define "warmstart.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "warmstart.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "warmstart.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "warmstart.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: warmstart
{{- end -}}

{{- define "warmstart.selectorLabels" -}}
app.kubernetes.io/name: {{ include "warmstart.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "warmstart.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "warmstart.operatorServiceAccount" -}}
{{- if .Values.operator.serviceAccount.create -}}
{{- default (printf "%s-operator" (include "warmstart.fullname" .)) .Values.operator.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.operator.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "warmstart.agentServiceAccount" -}}
{{- if .Values.agent.serviceAccount.create -}}
{{- default (printf "%s-agent" (include "warmstart.fullname" .)) .Values.agent.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.agent.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the snapshot signing key: the user's, or the one this chart makes. */}}
{{- define "warmstart.signingKeySecret" -}}
{{- .Values.agent.signingKeySecret | default (printf "%s-signing-key" (include "warmstart.fullname" .)) -}}
{{- end -}}

{{/*
The kind of snapshot store the agents keep (node-local, shared-volume or object-store), after refusing
settings that choose none of them coherently. The operator is told the kind: restore pods prefer the node
holding their snapshot only where no other node can read it.
*/}}
{{- define "warmstart.snapshotStore" -}}
{{- $store := .Values.agent.store -}}
{{- $objects := .Values.agent.objectStore -}}
{{- if $objects.bucket -}}
{{- if $store.claimName -}}
{{- fail "agent.store.claimName and agent.objectStore.bucket are two stores for the whole cluster: choose one (with the object store, each node's agent.store.hostPath is its cache)" -}}
{{- end -}}
{{- if and $objects.credentialsSecret $objects.credentialsFromEnvironment -}}
{{- fail "agent.objectStore.credentialsSecret and agent.objectStore.credentialsFromEnvironment exclude each other: set one" -}}
{{- end -}}
{{- if not (or $objects.credentialsSecret $objects.credentialsFromEnvironment) -}}
{{- fail "agent.objectStore.bucket needs agent.objectStore.credentialsSecret (a Secret with the keys access-key-id and secret-access-key), or agent.objectStore.credentialsFromEnvironment: true where the agent finds its own (AWS_* variables in agent.extraEnv, instance credentials)" -}}
{{- end -}}
{{- if has ".." (splitList "/" $objects.prefix) -}}
{{- fail (printf "agent.objectStore.prefix %q must not hold a .. segment" $objects.prefix) -}}
{{- end -}}
object-store
{{- else -}}
{{- range $setting := list "endpoint" "prefix" "region" "credentialsSecret" "credentialsFromEnvironment" "virtualHostedStyle" -}}
{{- if index $objects $setting -}}
{{- fail (printf "agent.objectStore.%s is set but agent.objectStore.bucket is not: name the bucket to use an object store" $setting) -}}
{{- end -}}
{{- end -}}
{{- if $store.claimName -}}
shared-volume
{{- else -}}
node-local
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Where the agent reads the object store's credentials: the mounted credentialsSecret. */}}
{{- define "warmstart.objectStoreCredentialsDir" -}}
/etc/warmstart/object-store
{{- end -}}

{{/* The agent's WARMSTART_S3_* variables (warmstart.snapshot.remote.config) for agent.objectStore. */}}
{{- define "warmstart.objectStoreEnv" -}}
{{- with .Values.agent.objectStore -}}
- name: WARMSTART_S3_BUCKET
  value: {{ .bucket | quote }}
{{- with .endpoint }}
- name: WARMSTART_S3_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- with .prefix }}
- name: WARMSTART_S3_PREFIX
  value: {{ . | quote }}
{{- end }}
{{- with .region }}
- name: WARMSTART_S3_REGION
  value: {{ . | quote }}
{{- end }}
{{- if .virtualHostedStyle }}
- name: WARMSTART_S3_VIRTUAL_HOSTED
  value: "1"
{{- end }}
{{- if .credentialsSecret }}
- name: WARMSTART_S3_CREDENTIALS_DIR
  value: {{ include "warmstart.objectStoreCredentialsDir" $ | quote }}
{{- end }}
- name: WARMSTART_S3_CONCURRENCY
  value: {{ .concurrency | quote }}
{{- end -}}
{{- end -}}

{{/* A number as a flag's value: a whole one without the exponent YAML's floats print with (3.1536e+07). */}}
{{- define "warmstart.number" -}}
{{- if eq (float64 .) (float64 (int64 .)) -}}
{{- int64 . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}
