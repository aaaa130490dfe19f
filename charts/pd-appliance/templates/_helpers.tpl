{{/* Names and labels. */}}

{{- define "pd-appliance.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* <fullname>-<component>, the fullname cut so the whole is a DNS-1123 label (63).
     Call with (list $ "prefill"). */}}
{{- define "pd-appliance.componentName" -}}
{{- $ctx := index . 0 -}}
{{- $component := index . 1 -}}
{{- $base := include "pd-appliance.fullname" $ctx | trunc (int (sub 62 (len $component))) | trimSuffix "-" -}}
{{- printf "%s-%s" $base $component -}}
{{- end -}}

{{- define "pd-appliance.selectorLabels" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ $ctx.Chart.Name }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "pd-appliance.labels" -}}
{{- $ctx := index . 0 -}}
{{ include "pd-appliance.selectorLabels" . }}
app.kubernetes.io/version: {{ $ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $ctx.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" $ctx.Chart.Name $ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{/* Images. */}}

{{/* repository:tag, or repository@sha256:... when the tag is a digest. */}}
{{- define "pd-appliance.imageRef" -}}
{{- $tag := index . 1 -}}
{{- printf "%s%s%s" (index . 0) (ternary "@" ":" (hasPrefix "sha256:" $tag)) $tag -}}
{{- end -}}

{{- define "pd-appliance.vllmImage" -}}
{{- $default := ternary "pd-appliance/vllm-cpu" "pd-appliance/vllm" (eq .Values.stack "cpu") -}}
{{- include "pd-appliance.imageRef" (list (.Values.images.vllm.repository | default $default) (.Values.images.vllm.tag | default .Chart.AppVersion)) -}}
{{- end -}}

{{- define "pd-appliance.slimImage" -}}
{{- include "pd-appliance.imageRef" (list .Values.images.slim.repository (.Values.images.slim.tag | default .Chart.AppVersion)) -}}
{{- end -}}

{{- define "pd-appliance.pullSecrets" -}}
{{- with .Values.images.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The keys: mounted from one Secret at /etc/pd-appliance/keys (files named as
     appliance/keys.py names them), never put in an argument or an environment value. */}}

{{- define "pd-appliance.keysDir" -}}/etc/pd-appliance/keys{{- end -}}

{{- define "pd-appliance.keysSecretName" -}}
{{- $k := .Values.keys -}}
{{- $inline := compact (list $k.apiKey $k.bootstrapToken $k.sideChannelKey) -}}
{{- if and $k.existingSecret $inline -}}
{{- fail "keys: give either keys.existingSecret or keys.apiKey, keys.bootstrapToken and keys.sideChannelKey, not both (set keys.existingSecret=\"\" to have the chart create the Secret)" -}}
{{- else if $k.existingSecret -}}
{{- $k.existingSecret -}}
{{- else if eq (len $inline) 3 -}}
{{- include "pd-appliance.componentName" (list . "keys") -}}
{{- else if $inline -}}
{{- fail "keys: keys.apiKey, keys.bootstrapToken and keys.sideChannelKey go together: give all three, or none and keys.existingSecret" -}}
{{- else -}}
{{- fail "keys: no keys: set keys.existingSecret to a Secret with api-key, bootstrap-token and side-channel.key (kubectl create secret generic NAME --from-file=keys/ from pdctl init's keys/), or give keys.apiKey, keys.bootstrapToken and keys.sideChannelKey" -}}
{{- end -}}
{{- end -}}

{{- define "pd-appliance.keysVolume" -}}
- name: keys
  secret:
    secretName: {{ include "pd-appliance.keysSecretName" . }}
    defaultMode: 256  # 0400: the containers run as root
    items:
      - {key: api-key, path: api-key}
      - {key: bootstrap-token, path: bootstrap-token}
      - {key: side-channel.key, path: side-channel.key}
{{- end -}}

{{- define "pd-appliance.keysMount" -}}
- name: keys
  mountPath: {{ include "pd-appliance.keysDir" . }}
  readOnly: true
{{- end -}}

{{/* Pod annotations: the user's, plus a digest of the keys, so new keys roll every pod
     that mounts them: of the inline keys, or of keys.existingSecret's data as the cluster
     has it now (lookup; `helm upgrade` after rotating the Secret rolls the pods). Where
     lookup sees no cluster (helm template, --dry-run) or no such Secret yet, the digest is
     of the Secret's name. */}}
{{- define "pd-appliance.podAnnotations" -}}
{{- $ctx := index . 0 -}}
{{- $ann := deepCopy ((index . 1) | default dict) -}}
{{- $k := $ctx.Values.keys -}}
{{- if not $k.existingSecret -}}
{{- $_ := set $ann "checksum/keys" (sha256sum (printf "%s\n%s\n%s" $k.apiKey $k.bootstrapToken $k.sideChannelKey)) -}}
{{- else -}}
{{- $secret := lookup "v1" "Secret" $ctx.Release.Namespace $k.existingSecret | default dict -}}
{{- $data := get $secret "data" | default dict -}}
{{- $digest := ternary (toJson $data) (printf "secret:%s" $k.existingSecret) (gt (len $data) 0) -}}
{{- $_ := set $ann "checksum/keys" (sha256sum $digest) -}}
{{- end -}}
{{- with $ann }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Scheduling: the user's nodeSelector, tolerations, affinity, priority class, and a spread
     across nodes. Call with (list $ "prefill"). */}}
{{- define "pd-appliance.scheduling" -}}
{{- $ctx := index . 0 -}}
{{- $component := index . 1 -}}
{{- $r := index $ctx.Values $component -}}
{{- with $r.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $r.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $r.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $r.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $r.topologySpread.enabled }}
topologySpreadConstraints:
  - topologyKey: kubernetes.io/hostname
    maxSkew: {{ $r.topologySpread.maxSkew }}
    whenUnsatisfiable: {{ $r.topologySpread.whenUnsatisfiable }}
    labelSelector:
      matchLabels:
        {{- include "pd-appliance.selectorLabels" . | nindent 8 }}
{{- end }}
{{- end -}}

{{- define "pd-appliance.podSecurityContext" -}}
securityContext:
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{/* The slim containers (proxy, sidecar) need no privilege and write nothing but /tmp. */}}
{{- define "pd-appliance.slimSecurityContext" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: [ALL]
{{- end -}}

{{- define "pd-appliance.pdbApiVersion" -}}
{{- /* policy/v1 from 1.21 (helm template knows group versions only, a server kinds too) */ -}}
{{- if and (.Capabilities.APIVersions.Has "policy/v1") (semverCompare ">=1.21-0" .Capabilities.KubeVersion.Version) -}}
policy/v1
{{- else -}}
policy/v1beta1
{{- end -}}
{{- end -}}
