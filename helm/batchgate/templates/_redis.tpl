{{/*
BATCHGATE_REDIS_URL for the gateway container, never holding a password in clear: either the whole
URL comes from a Secret, or the password does (REDIS_PASSWORD) and Kubernetes expands
$(REDIS_PASSWORD) into the composed URL when it starts the container. Nothing when redis.mode=none.
*/}}
{{- define "batchgate.redisEnv" -}}
{{- $r := .Values.redis }}
{{- if eq $r.mode "external" }}
{{- if $r.existingSecretUrlKey }}
- name: BATCHGATE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $r.existingSecret }}
      key: {{ $r.existingSecretUrlKey }}
{{- else if $r.url }}
- name: BATCHGATE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "batchgate.secretName" . }}
      key: redis-url
{{- else }}
{{- include "batchgate.redisComposedUrl" (dict "ctx" . "host" $r.host "port" $r.port "db" $r.db "tls" $r.tls "username" $r.username) }}
{{- end }}
{{- else if eq $r.mode "internal" }}
{{- include "batchgate.redisComposedUrl" (dict "ctx" . "host" (include "batchgate.redis.host" .) "port" 6379 "db" 0 "tls" false "username" "") }}
{{- end }}
{{- end }}

{{- define "batchgate.redisComposedUrl" -}}
{{- $secret := include "batchgate.redis.passwordSecret" .ctx }}
{{- $auth := "" }}
{{- if $secret }}
{{- /* Must precede the URL: $(VAR) only expands variables defined earlier in the list. */}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "batchgate.redis.passwordKey" .ctx }}
{{- $auth = printf "%s:$(REDIS_PASSWORD)@" .username }}
{{- else if .username }}
{{- $auth = printf "%s@" .username }}
{{- end }}
{{- $url := printf "%s://%s%s:%s/%s" (ternary "rediss" "redis" .tls) $auth .host (include "batchgate.envValue" .port) (include "batchgate.envValue" .db) }}
- name: BATCHGATE_REDIS_URL
  value: {{ include "batchgate.redis.withCa" (dict "ctx" .ctx "url" $url) | quote }}
{{- end }}
