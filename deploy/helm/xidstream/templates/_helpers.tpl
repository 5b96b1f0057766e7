{{/* Names, labels and the pieces every component shares. */}}

{{- define "xidstream.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "xidstream.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* selector labels of one component: include "xidstream.selector" (list . "collector") */}}
{{- define "xidstream.selector" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ $ctx.Chart.Name }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* A role's image: (list . ROLE), ROLE a key of image.repositories; one registry and tag for all. */}}
{{- define "xidstream.image" -}}
{{- $ctx := index . 0 -}}
{{- $img := $ctx.Values.image -}}
{{- if $img.repository -}}
{{- fail "image.repository is gone: each role has its own image now; set image.registry (and image.tag), or one role's image.repositories.<role> (values.yaml)" -}}
{{- end -}}
{{- $repo := required (printf "image.repositories.%s is required" (index . 1)) (index $img.repositories (index . 1)) -}}
{{ with $img.registry }}{{ . }}/{{ end }}{{ $repo }}:{{ $img.tag | default $ctx.Chart.AppVersion }}
{{- end -}}

{{/* Kafka settings every command reads from the environment. */}}
{{- define "xidstream.kafkaEnv" -}}
- name: XIDSTREAM_BOOTSTRAP
  value: {{ required "kafka.bootstrap is required" .Values.kafka.bootstrap | quote }}
- name: XIDSTREAM_TOPIC_PREFIX
  value: {{ .Values.kafka.topicPrefix | quote }}
- name: XIDSTREAM_PARTITIONS
  value: {{ .Values.kafka.partitions | quote }}
{{- end -}}

{{/* --kafka-config for a role: include "xidstream.kafkaArgs" (list . "collector") */}}
{{- define "xidstream.kafkaArgs" -}}
{{- $ctx := index . 0 -}}
{{- $c := index $ctx.Values.kafka.clientConfig (index . 1) -}}
{{- if $c.secretName }}
- --kafka-config
- /etc/xidstream/kafka/{{ $c.key }}
{{- end }}
{{- end -}}

{{- define "xidstream.kafkaMount" -}}
{{- $ctx := index . 0 -}}
{{- $c := index $ctx.Values.kafka.clientConfig (index . 1) -}}
{{- if $c.secretName }}
- name: kafka-{{ index . 1 | kebabcase }}
  mountPath: /etc/xidstream/kafka
  readOnly: true
{{- end }}
{{- end -}}

{{- define "xidstream.kafkaVolume" -}}
{{- $ctx := index . 0 -}}
{{- $c := index $ctx.Values.kafka.clientConfig (index . 1) -}}
{{- if $c.secretName }}
- name: kafka-{{ index . 1 | kebabcase }}
  secret:
    secretName: {{ $c.secretName }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* --verify-key per command key, --approver-key per approver key, --revoked-keys: files of the
     verify Secret (mounted at /etc/xidstream/verify). */}}
{{- define "xidstream.verifyArgs" -}}
{{- range .Values.verifyKeys.keys }}
- --verify-key
- /etc/xidstream/verify/{{ . }}
{{- end }}
{{- range (.Values.verifyKeys.approverKeys | default list) }}
- --approver-key
- /etc/xidstream/verify/{{ . }}
{{- end }}
{{- with .Values.verifyKeys.revoked }}
- --revoked-keys
- /etc/xidstream/verify/{{ . }}
{{- end }}
{{- end -}}

{{/* The pod spec parts of the non-root components (processor, cluster executor, topics Job):
     they pass Pod Security `restricted`. */}}
{{- define "xidstream.restrictedPod" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "xidstream.restrictedContainer" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* The GPU node match: one nodeSelectorTerm per label, so any label matches. */}}
{{- define "xidstream.gpuNodeTerms" -}}
{{- range .Values.gpuNodeLabels }}
- matchExpressions:
    - key: {{ . }}
      operator: In
      values: ["true"]
{{- end }}
{{- end -}}

{{/* How NVML and nvidia-smi reach the node containers (values: nvml.mode). */}}
{{- define "xidstream.nvmlEnv" -}}
{{- if eq .Values.nvml.mode "runtimeClass" }}
- name: NVIDIA_VISIBLE_DEVICES
  value: all
- name: NVIDIA_DRIVER_CAPABILITIES
  value: utility
{{- else if eq .Values.nvml.mode "hostLibrary" }}
- name: LD_LIBRARY_PATH
  value: /usr/local/nvidia/lib64
- name: PATH
  value: /usr/local/nvidia/bin:/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin
{{- end }}
{{- end -}}

{{- define "xidstream.nvmlMounts" -}}
{{- if eq .Values.nvml.mode "hostLibrary" }}
- {name: libnvidia-ml, mountPath: /usr/local/nvidia/lib64/libnvidia-ml.so.1, readOnly: true}
- {name: nvidia-smi, mountPath: /usr/local/nvidia/bin/nvidia-smi, readOnly: true}
{{- end }}
{{- end -}}

{{- define "xidstream.nvmlVolumes" -}}
{{- if eq .Values.nvml.mode "hostLibrary" }}
- name: libnvidia-ml
  hostPath: {path: {{ .Values.nvml.hostLibrary }}, type: File}
- name: nvidia-smi
  hostPath: {path: {{ .Values.nvml.hostNvidiaSmi }}, type: File}
{{- end }}
{{- end -}}

{{/* Labels of a component's objects and pods: include "xidstream.componentLabels" (list . "node") */}}
{{- define "xidstream.componentLabels" -}}
{{- $ctx := index . 0 -}}
{{ include "xidstream.selector" . }}
app.kubernetes.io/version: {{ $ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" $ctx.Chart.Name $ctx.Chart.Version }}
{{- end -}}

{{/* --identity-dir/--processor-identity of a node or cluster component (identity.enabled): the
processor's key as hex (identity.processorKey), else the file of the verify Secret every node pod
and the cluster executor mount (identity.processorKeyFile, which `xidstream keys generate` writes). */}}
{{- define "xidstream.identityArgs" -}}
{{- $ctx := index . 0 -}}
{{- if $ctx.Values.identity.enabled }}
- --identity-dir
- {{ index . 1 }}
- --processor-identity
{{- if $ctx.Values.identity.processorKey }}
- {{ $ctx.Values.identity.processorKey | quote }}
{{- else }}
- /etc/xidstream/verify/{{ $ctx.Values.identity.processorKeyFile }}
{{- end }}
{{- end }}
{{- end -}}

{{/* On a cluster (helm install/upgrade; `helm template` has none and lookup answers empty), with
identity on: fail at install, naming the commands that make them, when the enroller's Secret or a
file of the verify Secret that identity reads is missing; a pod would otherwise wait on a missing
Secret or exit on a missing file with nothing pointing at the cause. */}}
{{- define "xidstream.identityPreflight" -}}
{{- if and .Values.identity.enabled (lookup "v1" "Namespace" "" "kube-system") }}
{{- $i := .Values.identity }}
{{- $how := "xidstream keys generate --out keys/ && xidstream keys generate --out enroller/; kubectl -n %s create secret generic %s --from-file=%s=enroller/signing.key; the verify Secret %s needs signing.pub=keys/signing.pub, identity.pub=keys/identity.pub, enroller.pub=enroller/signing.pub (docs/operations.md, Install on Kubernetes); or identity.enabled=false, which runs the processor with --records-not-tied-to-nodes" }}
{{- $help := printf $how .Release.Namespace $i.enrollerSecretName $i.enrollerKey .Values.verifyKeys.secretName }}
{{- $en := lookup "v1" "Secret" .Release.Namespace $i.enrollerSecretName }}
{{- if not $en }}
{{- fail (printf "identity.enabled: namespace %s has no Secret %q (the enroller's private key, identity.enrollerSecretName). Make it: %s" .Release.Namespace $i.enrollerSecretName $help) }}
{{- end }}
{{- if not (hasKey ($en.data | default dict) $i.enrollerKey) }}
{{- fail (printf "identity.enabled: Secret %s/%s has no key %q (identity.enrollerKey). Make it: %s" .Release.Namespace $i.enrollerSecretName $i.enrollerKey $help) }}
{{- end }}
{{- $need := list $i.enrollerPublicKey }}
{{- if not $i.processorKey }}{{ $need = append $need $i.processorKeyFile }}{{ end }}
{{- range $ns := uniq (list $.Release.Namespace (include "xidstream.nodeNamespace" $)) }}
{{- $v := lookup "v1" "Secret" $ns $.Values.verifyKeys.secretName }}
{{- range $f := $need }}
{{- if not (hasKey (($v).data | default dict) $f) }}
{{- fail (printf "identity.enabled: the verify Secret %s/%s has no file %q. Make it: %s" $ns $.Values.verifyKeys.secretName $f $help) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}


{{/* The node DaemonSet's namespace: nodeNamespace.name, else the release's. */}}
{{- define "xidstream.nodeNamespace" -}}
{{- .Values.nodeNamespace.name | default .Release.Namespace -}}
{{- end -}}
