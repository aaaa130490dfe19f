{{/* P's and D's Deployment. A Deployment, not a StatefulSet: each pod's name is its
     engine id, so a replacement pod is a new engine (no stale KV or side-channel addresses
     under an old id), it comes up at once when a node dies (a StatefulSet waits until the
     old pod is known gone), and nothing per pod is stored. The rollout strategy is the
     role's (values.yaml: surge by default; maxSurge 0 where no GPU is spare); the
     PodDisruptionBudget bounds voluntary evictions. */}}
{{- define "pd-appliance.vllmDeployment" -}}
{{- $ctx := index . 0 -}}
{{- $role := index . 1 -}}
{{- $v := $ctx.Values -}}
{{- $r := index $v $role -}}
{{- $ann := deepCopy ($r.podAnnotations | default dict) -}}
{{- with $v.network.multus }}{{ $_ := set $ann "k8s.v1.cni.cncf.io/networks" . }}{{ end -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "pd-appliance.componentName" . }}
  labels:
    {{- include "pd-appliance.labels" . | nindent 4 }}
spec:
  replicas: {{ $r.replicas | int }}
  revisionHistoryLimit: 3
  strategy:
    type: RollingUpdate
    rollingUpdate: {maxSurge: {{ $r.strategy.maxSurge | toJson }}, maxUnavailable: {{ $r.strategy.maxUnavailable | toJson }}}
  selector:
    matchLabels:
      {{- include "pd-appliance.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pd-appliance.labels" . | nindent 8 }}
      {{- with (include "pd-appliance.podAnnotations" (list $ctx $ann) | trim) }}{{ . | nindent 6 }}{{ end }}
    spec:
      automountServiceAccountToken: false  # P and D never talk to the API server
      enableServiceLinks: false
      {{- if $v.network.hostNetwork }}
      hostNetwork: true  # the pod IP is the node's
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      # preStop's sleep, vLLM's drain (--shutdown-timeout), 10 s to exit
      terminationGracePeriodSeconds: {{ $r.terminationGracePeriodSeconds | int }}
      {{- with (include "pd-appliance.pullSecrets" $ctx | trim) }}{{ . | nindent 6 }}{{ end }}
      {{- include "pd-appliance.podSecurityContext" $ctx | nindent 6 }}
      {{- with (include "pd-appliance.scheduling" . | trim) }}{{ . | nindent 6 }}{{ end }}
      containers:
        - name: vllm
          image: {{ include "pd-appliance.vllmImage" $ctx }}
          imagePullPolicy: {{ $v.images.pullPolicy }}
          args:
            {{- include "pd-appliance.vllmArgs" . | nindent 12 }}
          env:
            {{- include "pd-appliance.vllmEnv" . | nindent 12 }}
          ports:
            - {name: http, containerPort: {{ index $v.ports $role | int }}, protocol: TCP}
          {{- include "pd-appliance.httpProbes" (list "http" (div (add (int $v.timeouts.startupS) 9) 10)) | trim | nindent 10 }}
          {{- include "pd-appliance.preStopSleep" $r.preStopSleepS | nindent 10 }}
          resources:
            {{- include "pd-appliance.vllmResources" . | nindent 12 }}
          securityContext:
            allowPrivilegeEscalation: false
            {{- if eq (include "pd-appliance.protocol" $ctx) "rdma" }}
            capabilities:  # RDMA pins (registers) GPU and host memory
              add: [IPC_LOCK]
            {{- end }}
          volumeMounts:
            {{- include "pd-appliance.keysMount" $ctx | nindent 12 }}
            - {name: shm, mountPath: /dev/shm}
            {{- include "pd-appliance.modelMount" $v | nindent 12 }}
        {{- if eq $role "prefill" }}
        {{- include "pd-appliance.bootstrapContainer" $ctx | nindent 8 }}
        {{- end }}
      volumes:
        {{- include "pd-appliance.vllmVolumes" . | nindent 8 }}
{{- end -}}
