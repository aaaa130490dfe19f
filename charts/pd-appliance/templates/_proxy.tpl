{{/* The proxy's config file (proxy.toml: appliance/proxy/settings.py's keys, as
     `python -m appliance.proxy --help` lists them), mounted from a ConfigMap.

     Three layers, the later winning: the proxy's own values (policy, split, itlSloMs,
     prefixIndex), then proxy.settings as given, then what the chart derives from values it
     shares with P and D or the pod (ports, timeouts, tracing, the keys' files, discovery,
     the block size, tokenizer, drainGraceS). proxy.settings may not name a derived key: it
     would silently fight the value the key comes from. Keys stay in the keys Secret: the
     file names where they are mounted. */}}
{{- define "pd-appliance.proxyConfig" -}}
{{- $v := .Values -}}
{{- $p := $v.proxy -}}
{{- $keys := include "pd-appliance.keysDir" . -}}
{{- $sel := printf "app.kubernetes.io/instance=%s,app.kubernetes.io/component=" .Release.Name -}}
{{- $derived := dict "host" "0.0.0.0" "port" (int $v.ports.proxy) "discovery" "kubernetes"
      "kubernetes" (dict "prefill_selector" (printf "%sprefill" $sel)
                         "decode_selector" (printf "%sdecode" $sel)
                         "prefill_port" (int $v.ports.prefill)
                         "decode_port" (int $v.ports.decode)
                         "bootstrap_port" (int $v.ports.bootstrap))
      "prefill_timeout_s" $v.timeouts.prefillS
      "kv_transfer_s" $v.timeouts.kvTransferS
      "decode_read_timeout_s" $v.timeouts.decodeReadS
      "drain_grace_s" $p.drainGraceS
      "kv_block_size" (int (include "pd-appliance.blockSize" .))
      "backend_api_key_file" (printf "%s/api-key" $keys)
      "bootstrap_token_file" (printf "%s/bootstrap-token" $keys)
      "side_channel_key_file" (printf "%s/side-channel.key" $keys) -}}
{{- with $v.tracing.otlpEndpoint }}
{{- $_ := merge $derived (dict "otlp_traces_endpoint" . "otlp_traces_protocol" $v.tracing.protocol
                               "otlp_traces_sample_ratio" $v.tracing.sampleRatio) -}}
{{- end -}}
{{- if $p.tokenizer }}{{ $_ := set $derived "tokenizer" $v.model.path }}{{ end -}}
{{- $chunk := include "pd-appliance.decodePrefillChunk" . | int -}}
{{- if gt $chunk 0 }}{{ $_ := set $derived "decode_prefill_chunk" $chunk }}{{ end -}}
{{- $file := dict "policy" $p.policy "split" $p.split "prefix_index" $p.prefixIndex
                  "itl_slo_ms" $p.itlSloMs -}}
{{- range $key, $value := $p.settings | default dict -}}
{{- $ours := get $derived $key -}}
{{- if and (kindIs "map" $ours) (kindIs "map" $value) -}}
{{- range $sub, $_ := $value -}}
{{- if hasKey $ours $sub -}}
{{- fail (printf "proxy.settings.%s.%s: the chart sets it from its other values" $key $sub) -}}
{{- end -}}
{{- end -}}
{{- else if hasKey $derived $key -}}
{{- fail (printf "proxy.settings.%s: the chart sets it from its other values (ports, timeouts, tracing, keys, model, proxy.drainGraceS, proxy.tokenizer)" $key) -}}
{{- end -}}
{{- $_ := set $file $key $value -}}
{{- end -}}
{{- range $key, $value := $derived -}}
{{- if and (kindIs "map" $value) (kindIs "map" (get $file $key)) -}}
{{- $_ := set $file $key (merge (deepCopy $value) (get $file $key)) -}}
{{- else -}}
{{- $_ := set $file $key $value -}}
{{- end -}}
{{- end -}}
# Written by the pd-appliance chart from its values: edit those (proxy.settings), not this.
{{ toToml $file }}
{{- end -}}

{{- define "pd-appliance.proxyConfigDir" -}}/etc/pd-appliance/proxy{{- end -}}
