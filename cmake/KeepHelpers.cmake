# Shared build settings and helpers for every KEEP target.

# keep_warnings(<target>): the warning set every target of ours builds with.
function(keep_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
      -Wno-missing-field-initializers>)
  if(KEEP_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
endfunction()

if(KEEP_SANITIZE)
  string(REPLACE ";" "," _keep_san "${KEEP_SANITIZE}")
  add_compile_options(-fsanitize=${_keep_san} -fno-omit-frame-pointer)
  add_link_options(-fsanitize=${_keep_san})
endif()

# keep_library(<name> SOURCES ... [DEPS ...] [PUBLIC_DEPS ...])
# A static library of ours; includes are rooted at the repository root ("shared/common/status.h").
function(keep_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS;PUBLIC_DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
  target_link_libraries(${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_DEPS})
  keep_warnings(${name})
endfunction()

# keep_executable(<name> SOURCES ... [DEPS ...])
function(keep_executable name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
  keep_warnings(${name})
endfunction()

# keep_add_test(<name> SOURCES ... [DEPS ...] LABELS unit|integration|gpu [TIMEOUT s] [ENV k=v ...])
# A doctest executable registered with CTest. The working directory is the repository root so that
# tests find fixtures as tests/fixtures/... and models as models/...
function(keep_add_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;DEPS;LABELS;ENV" ${ARGN})
  if(NOT KEEP_TESTS)
    return()
  endif()
  add_executable(${name} ${ARG_SOURCES} ${PROJECT_SOURCE_DIR}/tests/doctest_main.cpp)
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR} ${PROJECT_BINARY_DIR})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} doctest::doctest Threads::Threads)
  target_compile_definitions(${name} PRIVATE
    KEEP_SOURCE_DIR="${PROJECT_SOURCE_DIR}" KEEP_BINARY_DIR="${PROJECT_BINARY_DIR}")
  keep_warnings(${name})
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
  add_test(NAME ${name} COMMAND ${name} WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  if(NOT ARG_LABELS)
    message(FATAL_ERROR "keep_add_test(${name}): LABELS is required (unit, integration or gpu)")
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  set_tests_properties(${name} PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT}
    ENVIRONMENT "KEEP_BIN_DIR=${CMAKE_RUNTIME_OUTPUT_DIRECTORY};${ARG_ENV}")
endfunction()

# keep_add_script_test(<name> COMMAND ... LABELS ... [TIMEOUT s] [SKIP_RETURN_CODE n]): a test that is a script
# (e.g. the Prometheus scrape test, which drives real daemons).
function(keep_add_script_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT;SKIP_RETURN_CODE" "COMMAND;LABELS" ${ARGN})
  if(NOT KEEP_TESTS)
    return()
  endif()
  add_test(NAME ${name} COMMAND ${ARG_COMMAND} WORKING_DIRECTORY ${PROJECT_SOURCE_DIR})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  set_tests_properties(${name} PROPERTIES LABELS "${ARG_LABELS}" TIMEOUT ${ARG_TIMEOUT}
    ENVIRONMENT "KEEP_BIN_DIR=${CMAKE_RUNTIME_OUTPUT_DIRECTORY}")
  if(DEFINED ARG_SKIP_RETURN_CODE)  # here: a benchmark's CMakeLists may run with KEEP_TESTS off
    set_tests_properties(${name} PROPERTIES SKIP_RETURN_CODE ${ARG_SKIP_RETURN_CODE})
  endif()
endfunction()
